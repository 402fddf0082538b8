"""Admission control: reject new jobs while a stage is backed up.

One Lua script checks every stage queue's depth and the queued prompt tokens and, if the
job fits, reserves its tokens, all atomically, so concurrent API processes cannot
overshoot. A job counts toward its stage queue from admission on: admissions not yet
published are held in a short-lived set that the depth check adds to the preprocess queue.
Reserved tokens are released when the job's chord collects it, or at its deadline.

On RabbitMQ the script cannot read the queues: the caller passes depths sampled from the
broker (llmpipe/broker/queue_depth.py, cached for a fraction of a second) with the time of the
sample, and the script adds the jobs published since then (kept for 10 s in a second set),
so API processes admitting at once still see each other's jobs.

Each lane has its own budget (llmpipe/jobs/lanes.py): the interactive lane the full limits, the
batch lane ``lane_batch_share`` of them, both counted against everything queued (on Redis
every priority list of a stage queue). A batch backlog therefore stops at its share with
429s, and interactive requests are admitted into the rest.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from llmpipe.jobs.lanes import PRIORITY_STEPS, Lane, queue_keys
from llmpipe.stages import Stage


def stage_queues(inference_queue: str = Stage.INFERENCE.value) -> tuple[str, ...]:
    """The queues a job passes through: with several models its model's own inference queue
    (``inference.tiny``, llmpipe/models/served.py), so a model whose queue is backed up gets
    429 for its own requests while the other models' are still admitted."""
    return (Stage.PREPROCESS.value, inference_queue, Stage.POSTPROCESS.value)


# The stage queues that admission counts (the chord callback's is not one): one model's.
STAGE_QUEUES = stage_queues()

_PENDING = "llmpipe:admission:pending"  # zset job -> admitted_at, until its messages are published
_TOKENS = "llmpipe:admission:tokens"  # total reserved tokens
_JOBS = "llmpipe:admission:jobs"  # zset job -> deadline
_JOB_TOKENS = "llmpipe:admission:job_tokens"  # hash job -> tokens
_DRAINED = "llmpipe:admission:drained"  # jobs released so far (for the drain rate)
_RECENT = "llmpipe:admission:recent"  # zset job -> published_at, for 10 s (depths given by the caller)

_ADMIT = """
local now = tonumber(ARGV[1])
local max_depth = tonumber(ARGV[2])
local max_tokens = tonumber(ARGV[3])
local job = ARGV[4]
local tokens = tonumber(ARGV[5])
local deadline = tonumber(ARGV[6])
local nq = tonumber(ARGV[7])
local per = tonumber(ARGV[8])  -- Redis lists per stage queue (one per priority step), KEYS[1..nq * per]
local sampled_at = ARGV[9]  -- not '': the depths come in ARGV[10..], sampled then (RabbitMQ)
if sampled_at == '' then sampled_at = nil end
local b = nq * per
-- settle what expired: pending admissions older than 10 s and jobs past their deadline
if max_depth > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[b + 1], '-inf', now - 10) end
if sampled_at then redis.call('ZREMRANGEBYSCORE', KEYS[b + 5], '-inf', now - 10) end
local late = redis.call('ZRANGEBYSCORE', KEYS[b + 3], '-inf', now)
for _, j in ipairs(late) do
  local t = tonumber(redis.call('HGET', KEYS[b + 4], j) or '0')
  redis.call('DECRBY', KEYS[b + 2], t)
  redis.call('HDEL', KEYS[b + 4], j)
  redis.call('ZREM', KEYS[b + 3], j)
end
if max_depth > 0 then
  for i = 1, nq do
    local d = 0
    if sampled_at then
      d = tonumber(ARGV[9 + i])
      if i == 1 then d = d + redis.call('ZCOUNT', KEYS[b + 5], sampled_at, '+inf') end
    else
      for k = (i - 1) * per + 1, i * per do d = d + redis.call('LLEN', KEYS[k]) end
    end
    if i == 1 then d = d + redis.call('ZCARD', KEYS[b + 1]) end
    if d >= max_depth then return {0, i, d} end
  end
end
local total = tonumber(redis.call('GET', KEYS[b + 2]) or '0')
if max_tokens > 0 and total + tokens > max_tokens then
  return {0, 0, total}
end
redis.call('INCRBY', KEYS[b + 2], tokens)
redis.call('ZADD', KEYS[b + 3], deadline, job)
redis.call('HSET', KEYS[b + 4], job, tokens)
-- pending: only the depth check reads it
if max_depth > 0 then redis.call('ZADD', KEYS[b + 1], now, job) end
return {1, 0, total + tokens}
"""

_RELEASE = """
local t = redis.call('HGET', KEYS[3], ARGV[1])
if not t then return 0 end
redis.call('DECRBY', KEYS[1], tonumber(t))
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if ARGV[2] == '1' then redis.call('INCR', KEYS[4]) end
return 1
"""


@dataclass(frozen=True)
class Decision:
    admitted: bool
    stage: str | None = None  # which stage is full, or "tokens"
    depth: int = 0
    limit: int = 0
    retry_after_s: float = 0.0


def estimate_tokens(texts: list[str], max_tokens: int) -> int:
    """The API does not tokenize: about 4 characters per token, plus what may be generated."""
    return sum(math.ceil(len(t) / 4) + max_tokens for t in texts)


class DrainRate:
    """Jobs released per second, from samples of the drained counter over a sliding window."""

    def __init__(self, window_s: float = 15.0, clock=time.monotonic):
        self.window_s = window_s
        self._clock = clock
        self._samples: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def add(self, count: int, now: float | None = None) -> None:
        if now is None:
            now = self._clock()
        with self._lock:
            self._samples.append((now, count))
            while self._samples and now - self._samples[0][0] > self.window_s:
                self._samples.popleft()

    def rate(self) -> float:
        with self._lock:
            if len(self._samples) < 2:
                return 0.0
            (t0, c0), (t1, c1) = self._samples[0], self._samples[-1]
        return max(0.0, (c1 - c0) / (t1 - t0)) if t1 > t0 else 0.0


class Admission:
    """``depths``: None on Redis (the script reads the queues itself); on RabbitMQ, a reader
    whose ``sample(queues)`` returns the depths and when they were taken, on ``clock``."""

    def __init__(self, r: Any, *, max_queue_depth: int, max_queued_tokens: int, clock=time.time,
                 drain: DrainRate | None = None, fallback_retry_s: float = 2.0, max_retry_s: float = 120.0,
                 depths: Any = None, batch_share: float = 1.0):
        self.r = r
        self.batch_share = batch_share
        self.depths = depths
        self.max_queue_depth = max_queue_depth
        self.max_queued_tokens = max_queued_tokens
        self._clock = clock
        self.drain = drain or DrainRate()
        self.fallback_retry_s = fallback_retry_s
        self.max_retry_s = max_retry_s
        self._admit = r.register_script(_ADMIT)

    @property
    def enabled(self) -> bool:
        """Without a depth or token limit there is nothing to check or reserve."""
        return enabled(self.max_queue_depth, self.max_queued_tokens)

    def limits(self, lane: Lane) -> tuple[int, int]:
        """(queue depth, queued tokens) the lane is admitted under; 0: no limit."""
        if lane is Lane.INTERACTIVE:
            return self.max_queue_depth, self.max_queued_tokens
        return (_share(self.max_queue_depth, self.batch_share), _share(self.max_queued_tokens, self.batch_share))

    def try_admit(self, job_id: str, tokens: int, deadline: float, lane: Lane = Lane.INTERACTIVE,
                  inference_queue: str = Stage.INFERENCE.value) -> Decision:
        """``inference_queue``: the job's model's (each model's queue has its own depth limit;
        the CPU stages' queues and the queued tokens are shared by every model)."""
        if not self.enabled:
            return Decision(True)
        max_depth, max_tokens = self.limits(lane)
        queues = stage_queues(inference_queue)
        keys = [*(k for q in queues for k in queue_keys(q)), _PENDING, _TOKENS, _JOBS, _JOB_TOKENS, _RECENT]
        sampled = self.depths is not None and max_depth > 0
        for fresh in (False, True):
            args = [self._clock(), max_depth, max_tokens, job_id, tokens, deadline, len(queues), len(PRIORITY_STEPS)]
            if sampled:
                sample = self.depths.sample(queues, fresh=fresh)
                args += [repr(sample.taken_at), *(sample.depths[q] for q in queues)]
            else:
                args.append("")
            ok, which, depth = self._admit(keys=keys, args=args)
            # A stage refused on a cached broker sample is asked once more on a fresh one:
            # the jobs published since the sample count as queued, though workers may have
            # taken them already (a refusal has no side effect to undo).
            if ok or which == 0 or not sampled:
                break
        if ok:
            return Decision(True, depth=int(depth))
        self.sample_drain()
        if which == 0:
            stage, limit = "tokens", max_tokens
            per_job = max(1, tokens)
            excess = (int(depth) + tokens - limit) / per_job
        else:
            stage, limit = queues[int(which) - 1], max_depth
            excess = int(depth) - limit + 1
        return Decision(False, stage, int(depth), limit, self.retry_after(excess))

    def retry_after(self, excess_jobs: float) -> float:
        rate = self.drain.rate()
        if rate <= 0:
            return self.fallback_retry_s
        return min(self.max_retry_s, max(1.0, math.ceil(excess_jobs / rate)))

    def published(self, job_id: str) -> None:
        if self.max_queue_depth <= 0:  # no pending mark was made
            return
        if self.depths is None:
            self.r.zrem(_PENDING, job_id)
            return
        # Not in the broker's count until the next sample: counted from here until then.
        pipe = self.r.pipeline(transaction=True)
        pipe.zrem(_PENDING, job_id)
        pipe.zadd(_RECENT, {job_id: self._clock()})
        pipe.execute()

    def sample_drain(self) -> None:
        self.drain.add(int(self.r.get(_DRAINED) or 0))


def enabled(max_queue_depth: int, max_queued_tokens: int) -> bool:
    """Whether admission checks and reserves anything (a limit is set). The API and the
    workers read the same settings: workers release reservations only when it does."""
    return max_queue_depth > 0 or max_queued_tokens > 0


def _share(limit: int, share: float) -> int:
    return 0 if limit <= 0 else max(1, int(limit * share))


def release(r: Any, job_id: str, *, drained: bool = True) -> bool:
    """Frees a job's tokens: when it is collected (and counts it as drained, for the drain
    rate), or when it was admitted but could not be enqueued (``drained=False``)."""
    script = r.register_script(_RELEASE)
    return bool(script(keys=[_TOKENS, _JOBS, _JOB_TOKENS, _DRAINED], args=[job_id, int(drained)]))
