"""The job record in Redis: the one source of truth for a job's state and result.

Celery reads unknown, expired and pending ids alike as PENDING, so the API keeps its own
record per job, a hash at ``llmpipe:job:{id}``:

=============  =============================================================================
``status``     queued -> running -> one terminal status (succeeded, failed, expired, cancelled)
``created_at``, ``updated_at``, ``deadline``  epoch seconds
``n_prompts``, ``kind`` ("job" or "openai"), ``meta`` (JSON, optional)
``error``      JSON ``{"type", "message", "stage"?, "param"?}`` once the job ended without success
``result``     JSON ``JobResult``, written by the chord callback (``collect``) with the status
``waiters``    HTTP requests waiting on the job (OpenAI endpoints); when the last one goes
               away (client disconnect) the job is cancelled (``abandoned`` = 1)
``stream``     1 when a client streams its tokens: the terminal move marks the stream's end
=============  =============================================================================

Every move is one Lua script (``_MOVE``): a job moves to ``running`` only from ``queued``,
and to a terminal status only from a non-terminal one. The first terminal write wins and
never changes: a cancel or a watchdog expiry that lands after ``collect`` changes nothing,
and a result that arrives after a cancel is dropped. A terminal move also drops the job
from the watchdog's deadline index, optionally raises the cancel flag that workers check
(and broadcasts it), and publishes the move on the job's done channel, which the API's
waiters listen to. Readers (view, long-poll, SSE) read only this record; a long-poll that
read it before waiting takes the ended state from the move it was woken by (the move is
what the record then holds, and an ended record never changes).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any

from llmpipe.jobs.cancel import CHANNEL as CANCEL_CHANNEL
from llmpipe.jobs.cancel import cancel_key
from llmpipe.jobs.streaming import STREAM_TTL_S, stream_key
from llmpipe.messages import JobResult, JobStatus

_KEY = "llmpipe:job:{}"
KEY_PREFIX = "llmpipe:job:"
DEADLINE_INDEX = "llmpipe:job-deadlines"  # read by llmpipe.jobs.watchdog; holds unfinished jobs only


DONE_PREFIX = "llmpipe:job-done:"
DONE_PATTERN = DONE_PREFIX + "*"  # the API's waiter listens to every job's end on one subscription
# A wake carries the job's result when it is at most this long (bytes of JSON); a longer one
# is read from the record. Every API process receives every wake (api/waiter.py).
WAKE_RESULT_MAX = 64 * 1024


def done_channel(job_id: str) -> str:
    """Published on every terminal move of the job, with the move (:func:`parse_wake`)."""
    return DONE_PREFIX + job_id


def parse_wake(payload: bytes | str | None) -> dict | None:
    """The terminal move a done-channel message carries: ``status``, ``updated_at``, and
    ``error`` / ``result`` (JSON text) when the move wrote them; ``complete`` when the
    message holds every field the move wrote (the result was short enough). None for
    anything else (a message of an older version: plain status)."""
    if not payload:
        return None
    try:
        wake = json.loads(payload)
    except ValueError:
        return None
    return wake if isinstance(wake, dict) and "status" in wake else None


# KEYS: job hash, done channel, deadline index, cancel flag, cancel channel, token stream
# ARGV: status, now, error JSON or '', result JSON or '', cancel flag TTL (0: none), job id, mode,
#       token stream TTL, '1' when the wake may carry the result
# The done channel's message is the move itself (JSON): a waiter builds the ended view from
# it and the record it read before waiting, instead of reading the record again.
# A streaming job's terminal move also appends an end marker (field ``e``: the status) to its
# token stream, which wakes the SSE reader blocked on it (api/openai/sse.py).
# mode 'abandon': one waiter left; the job is cancelled only when it was the last one.
# Returns -1 unknown job, 0 not moved, 1 moved, 2 other waiters remain.
_MOVE = """
local rec = redis.call('HMGET', KEYS[1], 'status', 'stream')
local cur = rec[1]
if not cur then return -1 end
if ARGV[7] == 'abandon' then
  if redis.call('HINCRBY', KEYS[1], 'waiters', -1) > 0 then return 2 end
end
if cur == 'succeeded' or cur == 'failed' or cur == 'expired' or cur == 'cancelled' then return 0 end
if ARGV[1] == 'running' then
  if cur ~= 'queued' then return 0 end
  redis.call('HSET', KEYS[1], 'status', 'running', 'updated_at', ARGV[2])
  return 1
end
local fields = {'status', ARGV[1], 'updated_at', ARGV[2]}
if ARGV[3] ~= '' then table.insert(fields, 'error'); table.insert(fields, ARGV[3]) end
if ARGV[4] ~= '' then table.insert(fields, 'result'); table.insert(fields, ARGV[4]) end
if ARGV[7] == 'abandon' then table.insert(fields, 'abandoned'); table.insert(fields, '1') end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('ZREM', KEYS[3], ARGV[6])
if tonumber(ARGV[5]) > 0 then
  redis.call('SET', KEYS[4], '1', 'EX', ARGV[5])
  redis.call('PUBLISH', KEYS[5], ARGV[6])
end
if rec[2] == '1' then
  redis.call('XADD', KEYS[6], '*', 'e', ARGV[1])
  redis.call('EXPIRE', KEYS[6], ARGV[8])
end
local wake = {status=ARGV[1], updated_at=ARGV[2], complete=true}
if ARGV[3] ~= '' then wake['error'] = ARGV[3] end
if ARGV[4] ~= '' then
  if ARGV[9] == '1' then wake['result'] = ARGV[4] else wake['complete'] = false end
end
redis.call('PUBLISH', KEYS[2], cjson.encode(wake))
return 1
"""


# A stage starts work on a job: queued -> running; returns the status it found (nil: no record).
_START = """
local cur = redis.call('HGET', KEYS[1], 'status')
if cur == 'queued' then redis.call('HSET', KEYS[1], 'status', 'running', 'updated_at', ARGV[1]) end
return cur
"""

# Entries of the deadline index whose records are long gone are trimmed once per this many
# creates: the index stays bounded without a watchdog, at no cost per job.
TRIM_EVERY = 256


@dataclass
class JobRecord:
    job_id: str
    status: JobStatus
    created_at: float
    deadline: float
    n_prompts: int
    kind: str
    error: dict | None = None
    meta: dict | None = None
    result_json: str | None = None
    updated_at: float | None = None

    @property
    def result(self) -> JobResult | None:
        return JobResult.model_validate_json(self.result_json) if self.result_json else None

    @classmethod
    def from_hash(cls, job_id: str, h: dict[bytes | str, Any]) -> JobRecord:
        d = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v) for k, v in h.items()}
        return cls(
            job_id=job_id,
            status=JobStatus(d["status"]),
            created_at=float(d["created_at"]),
            deadline=float(d["deadline"]),
            n_prompts=int(d["n_prompts"]),
            kind=d.get("kind", "job"),
            error=json.loads(d["error"]) if d.get("error") else None,
            meta=json.loads(d["meta"]) if d.get("meta") else None,
            result_json=d.get("result") or None,
            updated_at=float(d["updated_at"]) if d.get("updated_at") else None,
        )

    def ended(self, wake: dict | None) -> JobRecord | None:
        """This record after the terminal move a done-channel message carries (the fields a
        terminal move writes; the others never change after create), or None when the
        message cannot stand for the record: not a terminal move, or one whose result was
        too long to carry."""
        if not wake or not wake.get("complete"):
            return None
        try:
            status = JobStatus(wake["status"])
        except ValueError:
            return None
        if not status.terminal:
            return None
        return dataclasses.replace(
            self, status=status, updated_at=float(wake["updated_at"]),
            error=json.loads(wake["error"]) if wake.get("error") else None, result_json=wake.get("result") or None)


class JobStore:
    def __init__(self, redis_client: Any, ttl_s: int):
        self.r = redis_client
        self.ttl_s = ttl_s
        self._move = self.r.register_script(_MOVE)
        self._start = self.r.register_script(_START)
        self._creates = 0

    @staticmethod
    def key(job_id: str) -> str:
        return _KEY.format(job_id)

    def create(self, job_id: str, *, n_prompts: int, deadline: float, kind: str = "job",
               meta: dict | None = None, now: float | None = None, pipe: Any = None, waiters: int = 0,
               stream: bool = False) -> None:
        """``stream``: a client reads the job's token stream; its end is marked in the stream."""
        if now is None:
            now = time.time()
        p = pipe if pipe is not None else self.r.pipeline(transaction=False)
        fields = {"status": JobStatus.QUEUED.value, "created_at": now, "deadline": deadline,
                  "n_prompts": n_prompts, "kind": kind, "updated_at": now}
        if meta:
            fields["meta"] = json.dumps(meta)
        if waiters:
            fields["waiters"] = waiters
        if stream:
            fields["stream"] = 1
        p.hset(self.key(job_id), mapping=fields)
        p.expire(self.key(job_id), self.ttl_s)
        # The watchdog settles the job at its deadline if nothing else has by then. A terminal
        # move removes it; entries whose records are long gone (no watchdog ran) are trimmed
        # here, so the index stays bounded without one.
        p.zadd(DEADLINE_INDEX, {job_id: deadline})
        if self._creates % TRIM_EVERY == 0:
            p.zremrangebyscore(DEADLINE_INDEX, "-inf", now - self.ttl_s)
        self._creates += 1
        if pipe is None:
            p.execute()

    def get(self, job_id: str) -> JobRecord | None:
        h = self.r.hgetall(self.key(job_id))
        return JobRecord.from_hash(job_id, h) if h else None

    def _run(self, job_id: str, status: JobStatus, *, error: dict | None = None, result: str = "",
             cancel_ttl_s: int = 0, mode: str = "set", now: float | None = None) -> int:
        if now is None:
            now = time.time()
        keys = [self.key(job_id), done_channel(job_id), DEADLINE_INDEX, cancel_key(job_id), CANCEL_CHANNEL,
                stream_key(job_id)]
        args = [status.value, now, json.dumps(error) if error else "", result, int(cancel_ttl_s), job_id, mode,
                STREAM_TTL_S, "1" if len(result) <= WAKE_RESULT_MAX else "0"]
        return int(self._move(keys=keys, args=args))

    def start(self, job_id: str, now: float | None = None) -> JobStatus | None:
        """A stage starts on the job: it moves to running if it was queued. Returns the
        status it had (a terminal one: the stage need not work on it), None without a record."""
        if now is None:
            now = time.time()
        cur = self._start(keys=[self.key(job_id)], args=[now])
        return JobStatus(cur.decode() if isinstance(cur, bytes) else cur) if cur else None

    def transition(self, job_id: str, status: JobStatus, error: dict | None = None, now: float | None = None,
                   result: str | None = None) -> bool:
        """Move the job to ``status`` (with its error, and the result JSON) unless it is terminal."""
        return self._run(job_id, status, error=error, result=result or "", now=now) == 1

    def finish(self, result: JobResult, now: float | None = None) -> bool:
        """The chord callback's move: the collected result and its status, in one step."""
        error = result.error.model_dump(mode="json", exclude_none=True) if result.error else None
        if error is not None:
            error["type"] = error.pop("reason")
        return self.transition(result.job_id, result.status, error, now=now,
                               result=result.model_dump_json(exclude_none=True))

    def stop(self, job_id: str, status: JobStatus, error: dict, now: float | None = None) -> bool:
        """Settle a job that must not run any more (cancel, deadline): the workers see the
        cancel flag and the inference worker aborts its running requests."""
        return self._run(job_id, status, error=error, cancel_ttl_s=self.ttl_s, now=now) == 1

    def delete(self, job_id: str, now: float | None = None) -> bool:
        """Forget the job (DELETE): a job that has not ended is cancelled first, so its workers
        stop; then the record goes, and a result that arrives later finds none to write."""
        self.stop(job_id, JobStatus.CANCELLED, {"type": "cancelled", "message": "deleted by the client"}, now=now)
        pipe = self.r.pipeline(transaction=False)
        pipe.delete(self.key(job_id))
        pipe.zrem(DEADLINE_INDEX, job_id)
        return bool(pipe.execute()[0])

    def abandon(self, job_id: str, now: float | None = None) -> int:
        """A waiting HTTP client went away; the job is cancelled if no other one waits on it.
        Returns 1 when cancelled, 2 when others still wait, 0 when already terminal."""
        error = {"type": "cancelled", "message": "the client disconnected before the job finished"}
        return self._run(job_id, JobStatus.CANCELLED, error=error, cancel_ttl_s=self.ttl_s, mode="abandon", now=now)
