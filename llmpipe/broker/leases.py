"""Worker leases on the Redis broker: a dead worker's messages go back in seconds, a live
worker's never (docs/architecture.md, "Leases").

Each consuming channel (one per worker main process) holds a lease, a member of the
sorted set ``llmpipe:leases`` scored by its expiry, which a thread renews. A message is
*claimed* under the lease in one Lua script: popped from its queue and written, in the same
atomic step, to kombu's ``unacked`` hash and ``unacked_index``, to the holder hash
``llmpipe:lease-holder`` (tag -> lease) and to the lease's own hash ``llmpipe:lease:{id}``
(tag -> where it came from). There is no instant when a message is neither in a queue nor
recorded as held, unlike kombu's BRPOP followed by a separate unacked write.

Any live consumer sweeps: a lease whose expiry has passed is dead, and one script puts
exactly the messages it still holds back at the front of their queues and deletes it. An
ack or a reject counts only while its lease still holds the tag (the holder hash says who
holds a tag now), so a stalled worker that wakes after its messages were handed on cannot
delete, or requeue a copy of, another worker's delivery.

Times are Redis server time (``TIME`` inside the scripts), so hosts with skewed clocks
agree on who is dead; tests pass ``now`` instead. Cost per message: the claim (one script
call, in place of kombu's BRPOP + pipeline) and the ack (one script call, in place of
kombu's pipeline). Renewals and sweeps are per process: one call each per tick.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import redis

from llmpipe.stages import WORKER_QUEUE_SEP, shared_queue

log = logging.getLogger("llmpipe.broker.leases")

PREFIX = "llmpipe:"
LEASES_KEY = PREFIX + "leases"
HOLDER_KEY = PREFIX + "lease-holder"
LEASE_TAGS_PREFIX = PREFIX + "lease:"
WAKE_PREFIX = PREFIX + "wake:"

_CLOCK = """
local function clock(a)
  if a ~= '' then return tonumber(a) end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
"""

# KEYS: leases. ARGV: now|'', ttl, id. Creates the lease (or pushes out its expiry).
CREATE_LUA = _CLOCK + """
local now = clock(ARGV[1])
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[3])
return 1
"""

# KEYS: leases. ARGV: now|'', ttl, id... Renews the leases still there (an expired one
# that nobody swept yet revives: nobody took its messages); returns those that are gone.
RENEW_LUA = _CLOCK + """
local now = clock(ARGV[1])
local until_ = now + tonumber(ARGV[2])
local lost = {}
for i = 3, #ARGV do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    redis.call('ZADD', KEYS[1], until_, ARGV[i])
  else
    table.insert(lost, ARGV[i])
  end
end
return lost
"""

# KEYS: unacked, unacked_index, holder, leases, lease tags. ARGV: lease id, now|'', wake
# prefix, then (queue key, queue name, ack) triples in the order to try. Pops the first
# message and records it as held by the lease, atomically; ack 0 marks a queue consumed
# without acks (kombu's no_ack: Celery's control replies), whose messages are handed over
# untracked, as kombu does. A claim that finds every key empty drops the queues' wake tokens
# (they are stale: no message waits), once per queue. Replies {'ok', key, payload, more}
# where more is 1 if the key it popped from still holds a message: a hint to claim again at
# once instead of waiting. Only that key is counted (one LLEN, not one per key and lane, which
# was a quarter of a request's broker commands): a message on another key still has its wake
# token, so a consumer told 0 wakes for it at once, and a token left stale by a direct claim
# costs one empty claim later, which drops it; {'raw', ...} for a message delivered untracked (no acks, or no
# delivery tag); {'empty'}; {'lost'} or {'expired'} when the lease cannot hold anything.
CLAIM_LUA = _CLOCK + """
local now = clock(ARGV[2])
local exp = redis.call('ZSCORE', KEYS[4], ARGV[1])
if not exp then return {'lost'} end
if tonumber(exp) <= now then return {'expired'} end
local got, src, acked
for i = 4, #ARGV, 3 do
  local p = redis.call('RPOP', ARGV[i])
  if p then got, src, acked = p, ARGV[i], ARGV[i + 2]; break end
end
if not got then
  local seen = {}
  for i = 4, #ARGV, 3 do
    if not seen[ARGV[i + 1]] then seen[ARGV[i + 1]] = true; redis.call('DEL', ARGV[3] .. ARGV[i + 1]) end
  end
  return {'empty'}
end
local more = 0
if redis.call('LLEN', src) > 0 then more = 1 end
if acked == '0' then return {'raw', src, got, more} end
local ok, d = pcall(cjson.decode, got)
if not ok or type(d) ~= 'table' or type(d.properties) ~= 'table' or type(d.properties.delivery_tag) ~= 'string' then
  return {'raw', src, got, more}
end
local tag = d.properties.delivery_tag
local ex, rk = '', ''
local di = d.properties.delivery_info
if type(di) == 'table' then
  if type(di.exchange) == 'string' then ex = di.exchange end
  if type(di.routing_key) == 'string' then rk = di.routing_key end
end
-- kombu's unacked entry, [message, exchange, routing key], written around the payload
-- as it is (never re-encoded), so that the sweep can cut the payload back out.
redis.call('HSET', KEYS[1], tag, '[' .. got .. ', ' .. cjson.encode(ex) .. ', ' .. cjson.encode(rk) .. ']')
redis.call('ZADD', KEYS[2], now, tag)
redis.call('HSET', KEYS[3], tag, ARGV[1])
redis.call('HSET', KEYS[5], tag, #got .. ':' .. src)
return {'ok', src, got, more}
"""

# KEYS: unacked, unacked_index, holder, lease tags. ARGV: tag, lease id. Acks only while
# the lease still holds the tag; 1 if it did.
ACK_LUA = """
redis.call('HDEL', KEYS[4], ARGV[1])
if redis.call('HGET', KEYS[3], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""

# KEYS: leases, unacked, unacked_index, holder. ARGV: now|'', limit, lease tags prefix,
# wake prefix, queue key separator, lease id|'', worker queue separator. With a lease id,
# releases that lease; else every lease expired by now (at most limit). A released lease's
# messages that it still holds go back to the front of their queues (oldest delivery
# frontmost), each with a wake token, and the lease is deleted; a message it claimed from
# a single worker's own queue (``inference~node``) goes to that queue's shared one instead,
# for any other worker to take (llmpipe/broker/worker_queues.py). Replies {id, restored count, ...}.
SWEEP_LUA = _CLOCK + """
local now = clock(ARGV[1])
local ids
if ARGV[6] ~= '' then
  ids = {ARGV[6]}
else
  ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. now, 'LIMIT', 0, tonumber(ARGV[2]))
end
local out = {}
for _, id in ipairs(ids) do
  local hk = ARGV[3] .. id
  local e = redis.call('HGETALL', hk)
  local items = {}
  for i = 1, #e, 2 do
    local tag, meta = e[i], e[i + 1]
    if redis.call('HGET', KEYS[4], tag) == id then
      redis.call('HDEL', KEYS[4], tag)
      local v = redis.call('HGET', KEYS[2], tag)
      local c = string.find(meta, ':', 1, true)
      if v and c then
        local n = tonumber(string.sub(meta, 1, c - 1))
        -- the entry as the claim wrote it; anything else is left to the visibility timeout
        if n and string.sub(v, 1, 1) == '[' and string.sub(v, n + 2, n + 2) == ',' then
          local score = tonumber(redis.call('ZSCORE', KEYS[3], tag) or '0')
          table.insert(items, {string.sub(v, 2, n + 1), string.sub(meta, c + 1), score})
          redis.call('HDEL', KEYS[2], tag)
          redis.call('ZREM', KEYS[3], tag)
        end
      end
    end
  end
  table.sort(items, function(a, b) return a[3] > b[3] end)
  for _, it in ipairs(items) do
    local key = it[2]
    local p = string.find(key, ARGV[5], 1, true)
    local q, suffix = key, ''
    if p then q, suffix = string.sub(key, 1, p - 1), string.sub(key, p) end
    local w = string.find(q, ARGV[7], 1, true)
    if w then q = string.sub(q, 1, w - 1) end
    redis.call('RPUSH', q .. suffix, it[1])
    redis.call('LPUSH', ARGV[4] .. q, '1')
  end
  redis.call('DEL', hk)
  redis.call('ZREM', KEYS[1], id)
  table.insert(out, id)
  table.insert(out, #items)
end
return out
"""


# For other scripts on Redis server time (llmpipe/routing/, llmpipe/broker/worker_queues.py,
# llmpipe/batches/lease.py).
CLOCK_LUA = _CLOCK


def now_arg(now: float | None) -> str:
    """A script's ``now`` argument: '' for Redis server time, else the time given (tests)."""
    return _now_arg(now)


def new_lease_id() -> str:
    """host:pid:random, so that a log line about a dead lease names the process."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def lease_tags_key(lease_id: str) -> str:
    return LEASE_TAGS_PREFIX + lease_id


def wake_key(queue: str) -> str:
    return WAKE_PREFIX + queue


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else v


def _now_arg(now: float | None) -> str:
    return "" if now is None else repr(float(now))


@dataclass
class Claim:
    status: str  # ok, raw, empty, lost, expired
    key: str | None = None
    payload: bytes | None = None
    more: bool = False


def parse_claim(reply) -> Claim:
    status = _s(reply[0])
    if status in ("ok", "raw"):
        return Claim(status, _s(reply[1]), reply[2], bool(int(reply[3])))
    return Claim(status)


class LeaseStore:
    """The lease scripts on one Redis, with kombu's unacked key names."""

    def __init__(self, r: redis.Redis, *, unacked_key: str = "unacked", unacked_index_key: str = "unacked_index",
                 sep: str = "\x06\x16"):
        self.r = r
        self.unacked_key = unacked_key
        self.unacked_index_key = unacked_index_key
        self.sep = sep
        self._create = r.register_script(CREATE_LUA)
        self._renew = r.register_script(RENEW_LUA)
        self._claim = r.register_script(CLAIM_LUA)
        self._ack = r.register_script(ACK_LUA)
        self._sweep = r.register_script(SWEEP_LUA)

    def load_scripts(self) -> None:
        """The claim is sent by sha on the consumer's own connection; a Redis that restarted
        has forgotten it."""
        for sc in (self._create, self._renew, self._claim, self._ack, self._sweep):
            self.r.script_load(sc.script)

    def create(self, lease_id: str, ttl_s: float, now: float | None = None) -> None:
        self._create(keys=[LEASES_KEY], args=[_now_arg(now), ttl_s, lease_id])

    def renew(self, lease_ids: Sequence[str], ttl_s: float, now: float | None = None) -> list[str]:
        """Push out the expiry of each lease; returns those that were swept (lost)."""
        if not lease_ids:
            return []
        return [_s(x) for x in self._renew(keys=[LEASES_KEY], args=[_now_arg(now), ttl_s, *lease_ids])]

    def claim_command(self, lease_id: str, keys: Iterable[tuple], now: float | None = None) -> list:
        """The EVALSHA arguments of a claim from (queue key, queue name[, acked]) tuples, in
        order (acked False: a no_ack consumer's queue, untracked); the consumer sends it on its
        own connection and reads the reply later."""
        argv = [lease_id, _now_arg(now), WAKE_PREFIX]
        for key, queue, *acked in keys:
            argv += [key, queue, "1" if (acked[0] if acked else True) else "0"]
        ks = [self.unacked_key, self.unacked_index_key, HOLDER_KEY, LEASES_KEY, lease_tags_key(lease_id)]
        return ["EVALSHA", self._claim.sha, len(ks), *ks, *argv]

    def claim(self, lease_id: str, keys: Iterable[tuple], now: float | None = None) -> Claim:
        cmd = self.claim_command(lease_id, keys, now)
        nk = cmd[2]
        return parse_claim(self._claim(keys=cmd[3:3 + nk], args=cmd[3 + nk:]))

    def ack(self, tag: str, lease_id: str) -> bool:
        """Forget a message this lease holds; False (and nothing changed) if it holds it no more."""
        keys = [self.unacked_key, self.unacked_index_key, HOLDER_KEY, lease_tags_key(lease_id)]
        return bool(self._ack(keys=keys, args=[tag, lease_id]))

    def _run_sweep(self, now: float | None, limit: int, lease_id: str) -> list[tuple[str, int]]:
        out = self._sweep(keys=[LEASES_KEY, self.unacked_key, self.unacked_index_key, HOLDER_KEY],
                          args=[_now_arg(now), limit, LEASE_TAGS_PREFIX, WAKE_PREFIX, self.sep, lease_id,
                                WORKER_QUEUE_SEP])
        return [(_s(out[i]), int(out[i + 1])) for i in range(0, len(out), 2)]

    def sweep(self, now: float | None = None, limit: int = 100) -> list[tuple[str, int]]:
        """Release every lease expired by ``now``: [(lease id, messages restored)]."""
        return self._run_sweep(now, limit, "")

    def release(self, lease_id: str) -> int:
        """Give back everything ``lease_id`` holds, to the front of its queues, and end it."""
        out = self._run_sweep(None, 1, lease_id)
        return out[0][1] if out else 0

    def holder(self, tag: str) -> str | None:
        v = self.r.hget(HOLDER_KEY, tag)
        return _s(v) if v is not None else None

    def is_live(self, lease_id: str) -> bool:
        """Present in the lease set (an expired one is swept within a sweep interval)."""
        return self.r.zscore(LEASES_KEY, lease_id) is not None


class LeaseKeeper:
    """Renews a process's leases and sweeps dead ones, on a daemon thread.

    ``tick`` is one round (renew, sweep, then ``drain``: the single workers' queues of dead
    leases back to their shared queues, llmpipe/broker/worker_queues.py) and takes the time
    from ``clock``; the thread only calls it every ``every_s``. A lease found gone (this
    process was silent longer than the TTL and another worker handed its messages on) is
    reported to ``on_lost``."""

    def __init__(self, store: LeaseStore, ttl_s: float, every_s: float, *,
                 on_lost: Callable[[str], None] = lambda lease_id: None,
                 on_swept: Callable[[str, int], None] | None = None,
                 drain: Callable[[], list[tuple[str, int]]] | None = None, clock: Callable[[], float] = time.monotonic):
        self.store = store
        self.ttl_s = ttl_s
        self.every_s = every_s
        self.on_lost = on_lost
        self.on_swept = on_swept or _log_swept
        self.drain = drain
        self.clock = clock
        self._ids: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self.last_renewed: float | None = None

    def hold(self, lease_id: str) -> None:
        with self._lock:
            self._ids.add(lease_id)

    def drop(self, lease_id: str) -> None:
        with self._lock:
            self._ids.discard(lease_id)

    def tick(self, now: float | None = None) -> None:
        if now is None:
            now = self.clock()
        with self._lock:
            ids = sorted(self._ids)
        if ids:
            for lost in self.store.renew(ids, self.ttl_s):
                self.drop(lost)
                self.on_lost(lost)
            self.last_renewed = now
        for lease_id, n in self.store.sweep():
            self.on_swept(lease_id, n)
        if self.drain is not None:
            for queue, n in self.drain():
                log.warning("worker queue %s has no live consumer: %d message(s) back at the front of %s", queue, n,
                            shared_queue(queue))

    def start(self) -> LeaseKeeper:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="llmpipe-lease", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            if os.getpid() != self._pid:  # a forked child holds no lease
                return
            try:
                self.tick()
            except redis.RedisError as exc:  # Redis away: the next tick tries again
                log.debug("lease tick failed: %s", exc)
            except Exception:
                log.warning("lease tick failed", exc_info=True)
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)


def _log_swept(lease_id: str, n: int) -> None:
    log.warning("lease %s expired (its worker died or stalled): %d message(s) back at the front of their queues",
                lease_id, n)
