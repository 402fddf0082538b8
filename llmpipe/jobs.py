"""The job registry in Redis: which ids the API issued, their deadline and status.

Celery reads unknown, expired and pending ids alike as PENDING, so the API keeps its own
record per job; the chord's result (stored under the job id) holds the JobResult.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from llmpipe.messages import JobStatus

_KEY = "llmpipe:job:{}"
DEADLINE_INDEX = "llmpipe:job-deadlines"  # read by llmpipe.watchdog


def done_channel(job_id: str) -> str:
    """Published when a job is settled outside its chord (cancelled, expired)."""
    return f"llmpipe:job-done:{job_id}"

# Moves a job to a new status unless it is already terminal; returns 1 when it moved.
_TRANSITION = """
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return -1 end
if cur == 'succeeded' or cur == 'failed' or cur == 'expired' or cur == 'cancelled' then return 0 end
if ARGV[1] == 'running' and cur ~= 'queued' then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'updated_at', ARGV[2])
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'error', ARGV[3]) end
if ARGV[1] ~= 'running' then redis.call('PUBLISH', KEYS[2], ARGV[1]) end
return 1
"""


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
        )


class JobStore:
    def __init__(self, redis_client: Any, ttl_s: int):
        self.r = redis_client
        self.ttl_s = ttl_s
        self._transition = self.r.register_script(_TRANSITION)

    @staticmethod
    def key(job_id: str) -> str:
        return _KEY.format(job_id)

    def create(self, job_id: str, *, n_prompts: int, deadline: float, kind: str = "job",
               meta: dict | None = None, now: float | None = None, pipe: Any = None) -> None:
        if now is None:
            now = time.time()
        p = pipe if pipe is not None else self.r.pipeline(transaction=False)
        fields = {"status": JobStatus.QUEUED.value, "created_at": now, "deadline": deadline,
                  "n_prompts": n_prompts, "kind": kind, "updated_at": now}
        if meta:
            fields["meta"] = json.dumps(meta)
        p.hset(self.key(job_id), mapping=fields)
        p.expire(self.key(job_id), self.ttl_s)
        # The watchdog settles the job at its deadline if nothing else has by then.
        p.zadd(DEADLINE_INDEX, {job_id: deadline})
        if pipe is None:
            p.execute()

    def get(self, job_id: str) -> JobRecord | None:
        h = self.r.hgetall(self.key(job_id))
        return JobRecord.from_hash(job_id, h) if h else None

    def transition(self, job_id: str, status: JobStatus, error: dict | None = None, now: float | None = None) -> bool:
        if now is None:
            now = time.time()
        res = self._transition(keys=[self.key(job_id), done_channel(job_id)], args=[status.value, now, json.dumps(error) if error else ""])
        return res == 1
