"""Admission control: reject new jobs while a stage is backed up.

One Lua script checks every stage queue's depth and the queued prompt tokens and, if the
job fits, reserves its tokens, all atomically, so concurrent API processes cannot
overshoot. A job counts toward its stage queue from admission on: admissions not yet
published are held in a short-lived set that the depth check adds to the preprocess queue.
Reserved tokens are released when the job's chord collects it, or at its deadline.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

STAGE_QUEUES = ("preprocess", "inference", "postprocess")
_PENDING = "llmpipe:admission:pending"  # zset job -> admitted_at, until its messages are published
_TOKENS = "llmpipe:admission:tokens"  # total reserved tokens
_JOBS = "llmpipe:admission:jobs"  # zset job -> deadline
_JOB_TOKENS = "llmpipe:admission:job_tokens"  # hash job -> tokens
_DRAINED = "llmpipe:admission:drained"  # jobs released so far (for the drain rate)

_ADMIT = """
local now = tonumber(ARGV[1])
local max_depth = tonumber(ARGV[2])
local max_tokens = tonumber(ARGV[3])
local job = ARGV[4]
local tokens = tonumber(ARGV[5])
local deadline = tonumber(ARGV[6])
local nq = tonumber(ARGV[7])
-- settle what expired: pending admissions older than 10 s and jobs past their deadline
redis.call('ZREMRANGEBYSCORE', KEYS[nq + 1], '-inf', now - 10)
local late = redis.call('ZRANGEBYSCORE', KEYS[nq + 3], '-inf', now)
for _, j in ipairs(late) do
  local t = tonumber(redis.call('HGET', KEYS[nq + 4], j) or '0')
  redis.call('DECRBY', KEYS[nq + 2], t)
  redis.call('HDEL', KEYS[nq + 4], j)
  redis.call('ZREM', KEYS[nq + 3], j)
end
if max_depth > 0 then
  for i = 1, nq do
    local d = redis.call('LLEN', KEYS[i])
    if i == 1 then d = d + redis.call('ZCARD', KEYS[nq + 1]) end
    if d >= max_depth then return {0, i, d} end
  end
end
local total = tonumber(redis.call('GET', KEYS[nq + 2]) or '0')
if max_tokens > 0 and total + tokens > max_tokens then
  return {0, 0, total}
end
redis.call('INCRBY', KEYS[nq + 2], tokens)
redis.call('ZADD', KEYS[nq + 3], deadline, job)
redis.call('HSET', KEYS[nq + 4], job, tokens)
redis.call('ZADD', KEYS[nq + 1], now, job)
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
    def __init__(self, r: Any, *, max_queue_depth: int, max_queued_tokens: int, clock=time.time,
                 drain: DrainRate | None = None, fallback_retry_s: float = 2.0, max_retry_s: float = 120.0):
        self.r = r
        self.max_queue_depth = max_queue_depth
        self.max_queued_tokens = max_queued_tokens
        self._clock = clock
        self.drain = drain or DrainRate()
        self.fallback_retry_s = fallback_retry_s
        self.max_retry_s = max_retry_s
        self._admit = r.register_script(_ADMIT)

    def try_admit(self, job_id: str, tokens: int, deadline: float) -> Decision:
        keys = [*STAGE_QUEUES, _PENDING, _TOKENS, _JOBS, _JOB_TOKENS]
        ok, which, depth = self._admit(keys=keys, args=[
            self._clock(), self.max_queue_depth, self.max_queued_tokens, job_id, tokens, deadline, len(STAGE_QUEUES)])
        if ok:
            return Decision(True, depth=int(depth))
        self.sample_drain()
        if which == 0:
            stage, limit = "tokens", self.max_queued_tokens
            per_job = max(1, tokens)
            excess = (int(depth) + tokens - limit) / per_job
        else:
            stage, limit = STAGE_QUEUES[int(which) - 1], self.max_queue_depth
            excess = int(depth) - limit + 1
        return Decision(False, stage, int(depth), limit, self.retry_after(excess))

    def retry_after(self, excess_jobs: float) -> float:
        rate = self.drain.rate()
        if rate <= 0:
            return self.fallback_retry_s
        return min(self.max_retry_s, max(1.0, math.ceil(excess_jobs / rate)))

    def published(self, job_id: str) -> None:
        self.r.zrem(_PENDING, job_id)

    def sample_drain(self) -> None:
        self.drain.add(int(self.r.get(_DRAINED) or 0))


def release(r: Any, job_id: str, *, drained: bool = True) -> bool:
    """Frees a job's tokens: when it is collected (and counts it as drained, for the drain
    rate), or when it was admitted but could not be enqueued (``drained=False``)."""
    script = r.register_script(_RELEASE)
    return bool(script(keys=[_TOKENS, _JOBS, _JOB_TOKENS, _DRAINED], args=[job_id, int(drained)]))
