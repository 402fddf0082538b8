"""Dead letters: requests and jobs that failed for good, kept for an operator to list.

What lands here (docs/reliability.md):

- a request the engine kept failing on after batch isolation and retries (a poison
  request, or a transient error such as out-of-memory that did not go away);
- a request delivered more than ``max_deliveries`` times, each time losing its worker (it
  kills the engine): it is not run again;
- a task that raised an unexpected exception (its job ends ``failed``);
- a job the watchdog settled as ``expired`` because nothing finished it by its deadline.

Storage: one sorted set ``llmpipe:deadletter`` (score: when; member: the JSON entry).
Each write drops entries older than ``ttl_s`` and keeps at most ``max_entries``, and the key
itself expires ``ttl_s`` after the last write, so the set stays bounded.

List them with ``python -m llmpipe.jobs.deadletter`` (``--json``, ``--limit N``, ``--purge``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from llmpipe.broker.redis_clients import connect
from llmpipe.jobs.store import JobStore
from llmpipe.messages import ErrorReason, JobStatus
from llmpipe.settings import get_settings
from llmpipe.stages import task_stage

log = logging.getLogger("llmpipe.jobs.deadletter")
_worker_log = logging.getLogger("llmpipe.worker")  # a task's failure is the worker's to log

KEY = "llmpipe:deadletter"
DEFAULT_TTL_S = 7 * 24 * 3600
DEFAULT_MAX_ENTRIES = 10_000


class DeadLetters:
    def __init__(self, r: Any, *, ttl_s: int = DEFAULT_TTL_S, max_entries: int = DEFAULT_MAX_ENTRIES,
                 clock: Callable[[], float] = time.time, key: str = KEY):
        self.r = r
        self.ttl_s = int(ttl_s)
        self.max_entries = int(max_entries)
        self._clock = clock
        self.key = key

    def record(self, *, stage: str | None, reason: str, message: str, job_id: str | None = None,
               request_id: str | None = None, task: str | None = None, task_id: str | None = None,
               deliveries: int | None = None, **extra: Any) -> dict | None:
        """Add an entry; never raises (a dead-letter write must not fail the stage)."""
        now = self._clock()
        entry = {
            "id": uuid.uuid4().hex, "at": round(now, 3), "stage": stage, "reason": reason, "message": message[:2000],
            "job_id": job_id, "request_id": request_id, "task": task, "task_id": task_id, "deliveries": deliveries,
            **extra,
        }
        entry = {k: v for k, v in entry.items() if v is not None}
        try:
            pipe = self.r.pipeline(transaction=False)
            pipe.zadd(self.key, {json.dumps(entry, separators=(",", ":"), default=str): now})
            pipe.zremrangebyscore(self.key, "-inf", now - self.ttl_s)
            pipe.zremrangebyrank(self.key, 0, -(self.max_entries + 1))
            pipe.expire(self.key, self.ttl_s)
            pipe.execute()
        except Exception as exc:
            log.error("could not dead-letter %s (%s): %s", request_id or job_id or task_id, exc, entry)
            return None
        log.warning("dead-lettered stage=%s reason=%s job=%s request=%s: %s", stage, reason, job_id, request_id,
                    entry["message"])
        return entry

    def list(self, limit: int = 100) -> list[dict]:
        """Newest first."""
        self.r.zremrangebyscore(self.key, "-inf", self._clock() - self.ttl_s)
        raw = self.r.zrevrange(self.key, 0, max(0, limit - 1)) if limit > 0 else []
        return [json.loads(m) for m in raw]

    def count(self) -> int:
        return int(self.r.zcard(self.key))

    def remove(self, entry_id: str) -> bool:
        for member in self.r.zrange(self.key, 0, -1):
            if json.loads(member).get("id") == entry_id:
                return bool(self.r.zrem(self.key, member))
        return False

    def purge(self) -> int:
        n = self.count()
        self.r.delete(self.key)
        return n


class TaskFailures:
    """A task raised an unexpected exception (workers/signals.py, Celery's task_failure):
    a dead letter is kept, and its job ends ``failed`` (the job record is what the API
    reads; the chord fails too)."""

    def __init__(self, deadletters: DeadLetters, jobs: JobStore):
        self.deadletters = deadletters
        self.jobs = jobs

    def record(self, name: str, task_id: str | None, exception: BaseException, args: Any = None,
               kwargs: dict | None = None) -> None:
        """``name``: the task's; ``args``/``kwargs``: what it was called with (a stage message
        first, or a chord callback's ``job_id``). Never raises: bookkeeping must not fail the failure path."""
        try:
            msg = args[0] if args and isinstance(args[0], dict) else {}
            job_id = msg.get("job_id") or (kwargs or {}).get("job_id")
            index = msg.get("index")
            what = f"{type(exception).__name__}: {exception}"
            self.deadletters.record(
                stage=task_stage(name), reason="task_failure", message=what, job_id=job_id,
                request_id=f"{job_id}-{index}" if job_id and index is not None else None, task=name, task_id=task_id)
            if job_id:
                self.jobs.transition(job_id, JobStatus.FAILED, {"type": ErrorReason.INTERNAL.value, "message": what,
                                                                "stage": task_stage(name)})
        except Exception:
            _worker_log.exception("could not dead-letter task %s", task_id)


def _format(entries: list[dict]) -> str:
    lines = []
    for e in entries:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["at"]))
        who = e.get("request_id") or e.get("job_id") or e.get("task_id") or "-"
        lines.append(f"{when}  {e.get('stage') or '-':<12} {e['reason']:<16} {who}  {e['message']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m llmpipe.jobs.deadletter``: list (or purge) the dead letters of LLMPIPE_REDIS_URL."""
    ap = argparse.ArgumentParser(prog="llmpipe deadletter", description=main.__doc__)
    ap.add_argument("--redis-url", default=None)
    ap.add_argument("--limit", type=int, default=50)
    ap.add_argument("--json", action="store_true", help="one JSON entry per line")
    ap.add_argument("--purge", action="store_true", help="delete every entry")
    args = ap.parse_args(argv)
    s = get_settings()
    r = connect(args.redis_url or s.redis_url, s.redis_sentinel_master, socket_connect_timeout=3, socket_timeout=5)
    dl = DeadLetters(r, ttl_s=s.deadletter_ttl_s, max_entries=s.deadletter_max_entries)
    if args.purge:
        print(f"purged {dl.purge()} dead letters")
        return 0
    entries = dl.list(args.limit)
    if args.json:
        for e in entries:
            print(json.dumps(e))
    else:
        print(f"{dl.count()} dead letters (newest first, at most {args.limit} shown)")
        if entries:
            print(_format(entries))
    return 0


if __name__ == "__main__":
    sys.exit(main())
