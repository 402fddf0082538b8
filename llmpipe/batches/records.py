"""The batch record in Redis: a batch's state and progress, durable as job records are.

A hash at ``llmpipe:batch:<id>`` holds what OpenAI's ``Batch`` object says: the status and
each status's ``*_at`` time, the endpoint and input file, ``expires_at`` (the end of its
``completion_window``), the request counts and token usage, the output and error file ids
and, for a batch that failed validation, its ``errors``. Every status move is one Lua
script (``_MOVE``): it happens only from the statuses the caller names, so a cancel that
lands after the batch completed changes nothing and two processes never both finish a
batch. The move also keeps the count of batches per status (the metrics) and the set of
batches that still need a feeder (``ACTIVE``).

Status graph (OpenAI's)::

    validating -> in_progress -> finalizing -> completed
    validating -> failed          in_progress -> expired
    validating | in_progress -> cancelling -> cancelled

Lines retried after their job expired keep their run number in ``llmpipe:batch:<id>:attempts``
(line -> run), so a feeder that takes the batch over attaches to the job that runs now.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from llmpipe.batches.paging import hgetalls, page

_KEY = "llmpipe:batch:"
INDEX = "llmpipe:batches"  # zset id -> created_at
EXPIRY = "llmpipe:batches-expiry"  # zset id -> when the record and its files go
ACTIVE = "llmpipe:batches:active"  # set: batches a feeder still has work on
BY_STATUS = "llmpipe:batches:by-status"  # hash status -> batches in it
BACKSTOP_S = 24 * 3600  # the record outlives its expiry by this much, so the janitor sees its status


class BatchStatus(StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED)

    @property
    def at(self) -> str | None:
        """The field that records when the batch entered this status (``created_at`` for validating)."""
        return None if self is BatchStatus.VALIDATING else f"{self.value}_at"


TIMESTAMPS = tuple(s.at for s in BatchStatus if s.at)
_INTS = ("total", "completed", "failed", "input_tokens", "output_tokens")

# KEYS: record, by-status, active. ARGV: to, terminal (1/0), id, n from-statuses, from...,
# then field/value pairs. 1 moved, 0 not (its status is not one of from), -1 no record.
_MOVE = """
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return -1 end
local n = tonumber(ARGV[4])
local ok = false
for i = 5, 4 + n do if ARGV[i] == cur then ok = true end end
if not ok then return 0 end
local fields = {'status', ARGV[1]}
for i = 5 + n, #ARGV do table.insert(fields, ARGV[i]) end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('HINCRBY', KEYS[2], cur, -1)
redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
if ARGV[2] == '1' then redis.call('SREM', KEYS[3], ARGV[3]) end
return 1
"""

# KEYS: record. ARGV: field/value pairs. Progress of a batch that has not ended.
_PROGRESS = """
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur or cur == 'completed' or cur == 'failed' or cur == 'expired' or cur == 'cancelled' then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""


@dataclass
class BatchRecord:
    id: str
    status: BatchStatus
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: float
    expires_at: float
    metadata: dict | None = None
    model: str | None = None
    times: dict[str, float] = field(default_factory=dict)  # in_progress_at, completed_at, ...
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict] | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0

    def to_hash(self) -> dict[str, Any]:
        h: dict[str, Any] = {"id": self.id, "status": self.status.value, "endpoint": self.endpoint,
                             "input_file_id": self.input_file_id, "completion_window": self.completion_window,
                             "created_at": self.created_at, "expires_at": self.expires_at,
                             **{k: getattr(self, k) for k in _INTS}, **self.times}
        if self.metadata is not None:
            h["metadata"] = json.dumps(self.metadata)
        for k in ("model", "output_file_id", "error_file_id"):
            if getattr(self, k) is not None:
                h[k] = getattr(self, k)
        if self.errors is not None:
            h["errors"] = json.dumps(self.errors)
        return h

    @classmethod
    def from_hash(cls, h: dict) -> BatchRecord:
        d = {_s(k): _s(v) for k, v in h.items()}
        return cls(
            id=d["id"], status=BatchStatus(d["status"]), endpoint=d["endpoint"], input_file_id=d["input_file_id"],
            completion_window=d["completion_window"], created_at=float(d["created_at"]),
            expires_at=float(d["expires_at"]), metadata=json.loads(d["metadata"]) if d.get("metadata") else None,
            model=d.get("model") or None, times={k: float(d[k]) for k in TIMESTAMPS if d.get(k)},
            output_file_id=d.get("output_file_id") or None, error_file_id=d.get("error_file_id") or None,
            errors=json.loads(d["errors"]) if d.get("errors") else None, **{k: int(d.get(k) or 0) for k in _INTS})


class BatchStore:
    def __init__(self, r: Any, *, retention_s: int, clock=time.time):
        self.r = r
        self.retention_s = retention_s
        self._clock = clock
        self._move = r.register_script(_MOVE)
        self._progress = r.register_script(_PROGRESS)

    @staticmethod
    def key(batch_id: str) -> str:
        return _KEY + batch_id

    @staticmethod
    def attempts_key(batch_id: str) -> str:
        return f"{_KEY}{batch_id}:attempts"

    def forget_at(self, rec: BatchRecord) -> float:
        """When the record and its files go: the retention after its window ends at the latest."""
        return rec.expires_at + self.retention_s

    def create(self, rec: BatchRecord) -> None:
        k = self.key(rec.id)
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(k, mapping=rec.to_hash())
        pipe.expireat(k, int(self.forget_at(rec) + BACKSTOP_S))
        pipe.zadd(INDEX, {rec.id: rec.created_at})
        pipe.zadd(EXPIRY, {rec.id: self.forget_at(rec)})
        pipe.sadd(ACTIVE, rec.id)
        pipe.hincrby(BY_STATUS, rec.status.value, 1)
        pipe.execute()

    def get(self, batch_id: str) -> BatchRecord | None:
        h = self.r.hgetall(self.key(batch_id))
        return BatchRecord.from_hash(h) if h else None

    def move(self, batch_id: str, to: BatchStatus, frm: tuple[BatchStatus, ...], fields: dict | None = None,
             now: float | None = None) -> bool:
        """``to`` (stamping its ``*_at``) if the batch is in one of ``frm``, with ``fields``."""
        if now is None:
            now = self._clock()
        pairs: list[Any] = []
        for k, v in {**({to.at: now} if to.at else {}), **(fields or {})}.items():
            pairs += [k, json.dumps(v) if isinstance(v, (dict, list)) else v]
        args = [to.value, int(to.terminal), batch_id, len(frm), *(s.value for s in frm), *pairs]
        return self._move(keys=[self.key(batch_id), BY_STATUS, ACTIVE], args=args) == 1

    def progress(self, batch_id: str, **fields: Any) -> bool:
        """Counts and usage of a batch that has not ended (one that has keeps its final ones)."""
        args = [x for kv in fields.items() for x in kv]
        return bool(args) and self._progress(keys=[self.key(batch_id)], args=args) == 1

    def cancel(self, batch_id: str, now: float | None = None) -> bool:
        """The client cancels: a batch still validating or in progress starts cancelling; one
        that is finalizing or has ended is left as it is."""
        return self.move(batch_id, BatchStatus.CANCELLING, (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS), now=now)

    def active(self) -> list[str]:
        return sorted(_s(i) for i in self.r.smembers(ACTIVE))

    def drop_active(self, batch_id: str) -> None:
        """A batch in the active set whose record is gone (its retention passed)."""
        self.r.srem(ACTIVE, batch_id)

    def counts(self) -> dict[str, int]:
        """Batches per status, as kept by every move."""
        return {_s(k): max(0, int(v)) for k, v in self.r.hgetall(BY_STATUS).items()}

    def list(self, *, after: str | None = None, limit: int = 20) -> tuple[list[BatchRecord], bool] | None:
        return page(self.r, INDEX, after=after, limit=limit, desc=True,
                    load=lambda ids: [BatchRecord.from_hash(h) if h else None for h in hgetalls(self.r, _KEY, ids)])

    def attempts(self, batch_id: str) -> dict[int, int]:
        return {int(k): int(v) for k, v in self.r.hgetall(self.attempts_key(batch_id)).items()}

    def set_attempt(self, batch_id: str, line: int, run: int) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(self.attempts_key(batch_id), line, run)
        pipe.expire(self.attempts_key(batch_id), self.retention_s)
        pipe.execute()

    def due(self, now: float | None = None, limit: int = 200) -> list[str]:
        """Batches whose retention has passed (the janitor forgets them with :meth:`forget`)."""
        if now is None:
            now = self._clock()
        return [_s(i) for i in self.r.zrangebyscore(EXPIRY, "-inf", now, start=0, num=limit)]

    def forget(self, batch_id: str, extra_keys: tuple[str, ...] = ()) -> None:
        status = self.r.hget(self.key(batch_id), "status")
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(self.key(batch_id), self.attempts_key(batch_id), *extra_keys)
        pipe.zrem(INDEX, batch_id)
        pipe.zrem(EXPIRY, batch_id)
        pipe.srem(ACTIVE, batch_id)
        if status is not None:
            pipe.hincrby(BY_STATUS, _s(status), -1)
        pipe.execute()


def _s(v: Any) -> Any:
    return v.decode() if isinstance(v, bytes) else v
