"""An inference worker's membership in routing: that it is live, what it can hold, what it
holds now, and its engine's block size, kept in Redis for the routers (router.py).

A thread renews the membership every ``every_s`` for ``ttl_s`` (lease_ttl_s: a killed
worker stops being routed to as its lease expires) and, in the same script call, sets the
worker's in-flight count to what it really holds plus what waits in its own queue, and its
model's backlog to the interactive requests waiting in the shared queue. Between
two reports the routers add one per request they send it, so a burst sees each other's
placements; the report then replaces their estimate with the truth, so no count drifts
(a request moved to the shared queue by a sweep, a restarted worker). A worker that stops
leaves at once (its membership ends); members ended ``forget_after_s`` ago are forgotten
by the next report of any.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from llmpipe.broker.leases import CLOCK_LUA, now_arg
from llmpipe.routing.keys import BACKLOG_KEY, INFO_KEY, LOAD_KEY, MEMBERS_KEY

log = logging.getLogger("llmpipe.routing")

# KEYS: members, load, info, backlog, then the lists of the worker's own queue and those of
# its shared queue's interactive lane (Redis broker: what waits there counts). ARGV: now|'',
# worker queue, ttl, held, capacity, block size, queued (counted by the caller: RabbitMQ),
# forget after, how many of the lists are the own queue's, the shared queue ('' reports no
# backlog), its backlog counted by the caller (RabbitMQ). Replies the in-flight count set.
REPORT_LUA = CLOCK_LUA + """
local now = clock(ARGV[1])
local w = ARGV[2]
local n = tonumber(ARGV[4]) + tonumber(ARGV[7])
local own_end = 4 + tonumber(ARGV[9])
for i = 5, own_end do n = n + redis.call('LLEN', KEYS[i]) end
if ARGV[10] ~= '' then
  local waiting = tonumber(ARGV[11])
  for i = own_end + 1, #KEYS do waiting = waiting + redis.call('LLEN', KEYS[i]) end
  redis.call('HSET', KEYS[4], ARGV[10], waiting)
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), w)
redis.call('HSET', KEYS[2], w, n)
redis.call('HSET', KEYS[3], w, ARGV[5] .. ' ' .. ARGV[6])
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. (now - tonumber(ARGV[8])), 'LIMIT', 0, 20)
for _, o in ipairs(gone) do
  redis.call('ZREM', KEYS[1], o)
  redis.call('HDEL', KEYS[2], o)
  redis.call('HDEL', KEYS[3], o)
end
return n
"""

# KEYS: members, load, info. ARGV: now|'', worker queue. Ends the membership now (kept,
# expired, so that the lease sweep watches the worker's queue a while longer,
# llmpipe/broker/worker_queues.py); the next reports of the others forget it.
LEAVE_LUA = CLOCK_LUA + """
redis.call('ZADD', KEYS[1], clock(ARGV[1]), ARGV[2])
redis.call('HDEL', KEYS[2], ARGV[2])
redis.call('HDEL', KEYS[3], ARGV[2])
return 1
"""


class RouteMember:
    """One inference worker's membership. ``held()``: the requests the worker holds now
    (received, running or waiting in its batcher); ``queued()``: those waiting in its own
    queue that ``queue_keys`` does not count (RabbitMQ); ``queue_keys``: the Redis lists of its
    own queue (Redis broker), counted inside the script. ``shared``: its model's shared queue,
    whose backlog it reports: ``waiting()`` counted by the caller (RabbitMQ) plus the Redis
    lists ``shared_keys`` (Redis broker: the interactive lane's); None reports none."""

    def __init__(self, r: Any, queue: str, *, capacity: int, block_size: int, ttl_s: float,
                 held: Callable[[], int], queued: Callable[[], int] = lambda: 0, queue_keys: Sequence[str] = (),
                 shared: str | None = None, waiting: Callable[[], int] = lambda: 0, shared_keys: Sequence[str] = (),
                 every_s: float = 0.25, forget_after_s: float = 3600.0):
        self.r = r
        self.queue = queue
        self.capacity = capacity
        self.block_size = block_size
        self.ttl_s = ttl_s
        self.held = held
        self.queued = queued
        self.queue_keys = list(queue_keys)
        self.shared = shared
        self.waiting = waiting
        self.shared_keys = list(shared_keys) if shared is not None else []
        self.every_s = every_s
        self.forget_after_s = forget_after_s
        self._report = r.register_script(REPORT_LUA)
        self._leave = r.register_script(LEAVE_LUA)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def report(self, now: float | None = None) -> int:
        """Renew the membership, set the in-flight count and the model's backlog; returns the count set."""
        waiting = int(self.waiting()) if self.shared is not None else 0
        keys = [MEMBERS_KEY, LOAD_KEY, INFO_KEY, BACKLOG_KEY, *self.queue_keys, *self.shared_keys]
        return int(self._report(keys=keys,
                                args=[now_arg(now), self.queue, self.ttl_s, int(self.held()), self.capacity,
                                      self.block_size, int(self.queued()), self.forget_after_s, len(self.queue_keys),
                                      self.shared or "", waiting]))

    def leave(self, now: float | None = None) -> None:
        """No request is routed here any more (a warm shutdown); what waits in the own queue
        goes back to the shared queue (llmpipe/broker/worker_queues.py)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
        try:
            self._leave(keys=[MEMBERS_KEY, LOAD_KEY, INFO_KEY], args=[now_arg(now), self.queue])
        except Exception:  # Redis away: the membership expires by itself within ttl_s
            log.debug("could not leave routing", exc_info=True)

    def start(self) -> RouteMember:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="llmpipe-route-member", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.report()
            except Exception:  # Redis away: the next report tries again
                log.debug("routing report failed", exc_info=True)
            self._stop.wait(self.every_s)

