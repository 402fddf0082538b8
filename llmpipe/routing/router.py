"""Where preprocess sends an inference request: a worker's own queue, or the shared queue.

One script call per request decides and records, atomically, so that concurrent
preprocess processes see each other's placements:

1. the model's live workers (their membership, llmpipe/routing/members.py), their in-flight
   requests and their capacity; and while interactive requests wait in the model's shared
   queue (its backlog), the shared queue, behind them: a request routed past a backlog would
   be served before older ones (round robin between a worker's own queue and the shared
   one), which at 4 workers, c=128 made p99 3.6x what the shared queue's arrival order gives
   (docs/benchmarks.md, "Scaling across hosts");
2. the candidates in order: the workers where the prompt's longest remembered prefixes last
   went (longest first), then every live worker in the order of rendezvous hashing on the
   prompt's first block, so that a new prefix has a stable home;
3. the first candidate with room: fewer than its share, ``ceil(load_factor x (in-flight + 1)
   / live workers)`` (consistent hashing with bounded loads, Mirrokni et al. 2018), and fewer
   than its capacity (the requests it holds at once);
4. that worker's in-flight count goes up by one and every prefix of the prompt now points
   to it, for ``prefix_ttl_s``; when none had room, the backlog goes up by one.

Outcomes (``llmpipe_route_requests_total``): ``routed``, to the first candidate;
``spilled``, to a later one because the first had no room (or to the shared queue, when none
had); ``queued``, to the shared queue behind its backlog; ``fallback``, to the shared queue
without a decision (the router's Redis failed, or the prompt is shorter than one block, so
no engine caches any of it). While a model has fewer than two live workers nothing is routed
or counted (every request takes the shared queue) and the router asks again only every
``recheck_s``, so a model with one worker pays one script call per second, not one per
request.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmpipe.broker.leases import CLOCK_LUA, now_arg
from llmpipe.observability import metrics
from llmpipe.routing.keys import BACKLOG_KEY, INFO_KEY, LOAD_KEY, MEMBERS_KEY, prefix_key
from llmpipe.routing.prefix import block_hashes
from llmpipe.stages import WORKER_QUEUE_SEP

log = logging.getLogger("llmpipe.routing")

# vLLM's CacheConfig.DEFAULT_BLOCK_SIZE, until a worker reports its engine's own (on the CPU
# vLLM takes 128 unless told otherwise; a GPU backend may prefer another).
DEFAULT_BLOCK_SIZE = 16

ROUTED, SPILLED, QUEUED, FALLBACK, SINGLE = "routed", "spilled", "queued", "fallback", "single"

# KEYS: members, load, info, backlog, then the prompt's prefix keys, longest first. ARGV: now|'', the
# model's shared queue, load factor, prefix ttl (whole seconds), ring hash, worker queue
# separator. Replies {worker queue or '', outcome, match, block size, live workers}.
ROUTE_LUA = CLOCK_LUA + """
local now = clock(ARGV[1])
local mine = ARGV[2] .. ARGV[6]
local live = {}
for _, w in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')) do
  if string.sub(w, 1, #mine) == mine then live[#live + 1] = w end
end
if #live == 0 then return {'', 'single', 'none', 0, 0} end
local loads = redis.call('HMGET', KEYS[2], unpack(live))
local infos = redis.call('HMGET', KEYS[3], unpack(live))
local load, cap, total, bs = {}, {}, 0, 0
for i, w in ipairs(live) do
  local l = tonumber(loads[i]) or 0
  if l < 0 then l = 0 end
  load[w] = l
  total = total + l
  local c, b = string.match(infos[i] or '', '^(%d+) (%d+)$')
  cap[w] = tonumber(c) or math.huge
  if bs == 0 and b then bs = tonumber(b) end
end
if #live < 2 then return {'', 'single', 'none', bs, #live} end
if (tonumber(redis.call('HGET', KEYS[4], ARGV[2])) or 0) > 0 then
  redis.call('HINCRBY', KEYS[4], ARGV[2], 1)
  return {'', 'queued', 'none', bs, #live}
end
local share = math.ceil(tonumber(ARGV[3]) * (total + 1) / #live)
local order, seen, remembered = {}, {}, {}
if #KEYS > 4 then
  for _, w in ipairs(redis.call('MGET', unpack(KEYS, 5))) do
    if w and load[w] and not seen[w] then
      order[#order + 1] = w
      seen[w] = true
      remembered[w] = true
    end
  end
end
local ring = {}
for _, w in ipairs(live) do ring[#ring + 1] = {redis.sha1hex(ARGV[5] .. w), w} end
table.sort(ring, function(a, b) return a[1] > b[1] end)
for _, r in ipairs(ring) do
  if not seen[r[2]] then order[#order + 1] = r[2]; seen[r[2]] = true end
end
for i, w in ipairs(order) do
  if load[w] + 1 <= math.min(share, cap[w]) then
    redis.call('HINCRBY', KEYS[2], w, 1)
    for k = 5, #KEYS do redis.call('SET', KEYS[k], w, 'EX', ARGV[4]) end
    local match = 'hash'
    if remembered[w] then match = 'prefix' end
    local outcome = 'routed'
    if i > 1 then outcome = 'spilled' end
    return {w, outcome, match, bs, #live}
  end
end
redis.call('HINCRBY', KEYS[4], ARGV[2], 1)
return {'', 'spilled', 'none', bs, #live}
"""


@dataclass(frozen=True)
class Placement:
    """Where one request goes: ``queue`` a worker's own queue, or None for the shared queue."""

    queue: str | None
    outcome: str  # routed, spilled, queued, fallback, single (fewer than two live workers: not routed)
    match: str = "none"  # prefix (where its prefix went), hash (its prefix's home), none
    live_workers: int = 0


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class PrefixRouter:
    """Places requests for every served model; one per preprocess process.

    ``block_size``: the token block the prefixes are hashed over; None: the one the model's
    workers report (vLLM's block size), ``DEFAULT_BLOCK_SIZE`` until they have."""

    def __init__(self, r: Any, *, load_factor: float = 1.25, prefix_ttl_s: float = 600.0,
                 block_size: int | None = None, recheck_s: float = 1.0, clock: Callable[[], float] = time.monotonic):
        if load_factor < 1.0:
            raise ValueError("load_factor must be at least 1")
        self.r = r
        self.load_factor = load_factor
        self.prefix_ttl_s = max(1, math.ceil(prefix_ttl_s))
        self.block_size = block_size
        self.recheck_s = recheck_s
        self.clock = clock
        self._script = r.register_script(ROUTE_LUA)
        self._learned: dict[str, int] = {}  # shared queue -> the block size its workers report
        self._single_until: dict[str, float] = {}  # shared queue -> not routed until then
        self._live: dict[str, int] = {}  # shared queue -> its live workers at the last call

    def block_size_of(self, shared_queue: str) -> int:
        return self.block_size or self._learned.get(shared_queue) or DEFAULT_BLOCK_SIZE

    def place(self, shared_queue: str, token_ids: list[int], now: float | None = None) -> Placement:
        """Where a request of ``token_ids`` for the model on ``shared_queue`` goes. ``now``:
        the time on the router's clock and in the script (tests); None: the clock's, and
        Redis server time in the script. Never raises: a Redis error is a fallback."""
        local = self.clock() if now is None else now
        if local < self._single_until.get(shared_queue, float("-inf")):
            return Placement(None, SINGLE)
        hashes = block_hashes(token_ids, self.block_size_of(shared_queue))
        if not hashes:  # shorter than one block: no engine caches any of it
            live = self._live.get(shared_queue, 0)
            return Placement(None, FALLBACK if live >= 2 else SINGLE, live_workers=live)
        keys = [MEMBERS_KEY, LOAD_KEY, INFO_KEY, BACKLOG_KEY, *(prefix_key(shared_queue, h) for h in reversed(hashes))]
        try:
            reply = self._script(keys=keys, args=[now_arg(now), shared_queue, repr(self.load_factor),
                                                  self.prefix_ttl_s, hashes[0], WORKER_QUEUE_SEP])
        except Exception:  # Redis away: every request still has the shared queue
            log.debug("routing failed: the shared queue", exc_info=True)
            return Placement(None, FALLBACK)
        queue, outcome, match, bs, live = _s(reply[0]), _s(reply[1]), _s(reply[2]), int(reply[3]), int(reply[4])
        self._live[shared_queue] = live
        if bs:
            self._learned[shared_queue] = bs
        if outcome == SINGLE:
            self._single_until[shared_queue] = local + self.recheck_s
            return Placement(None, SINGLE, live_workers=live)
        return Placement(queue or None, outcome, match, live)

    def route(self, shared_queue: str, token_ids: list[int], model: str) -> str | None:
        """``place`` with its metrics: the worker queue to send the request to, or None."""
        p = self.place(shared_queue, token_ids)
        if p.outcome != SINGLE:
            metrics.ROUTE_REQUESTS.labels(model, p.outcome, p.match).inc()
        if shared_queue in self._live:
            metrics.ROUTE_WORKERS.labels(model).set(self._live[shared_queue])
        return p.queue
