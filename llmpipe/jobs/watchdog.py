"""The deadline watchdog: no job stays queued or running after its deadline.

Every stage drops a request whose deadline has passed, so a job normally ends by itself.
It cannot when nothing runs its messages any more: a worker that died and never came
back, a queue nobody consumes, a chord callback that was lost. The watchdog settles such
a job: some ``grace_s`` after its deadline, a job whose record is still ``queued`` or
``running`` is moved to

- the status of its chord result, if the result is there (the record only lagged); or
- ``failed`` if the chord ended FAILURE; or
- ``expired`` otherwise, with an ``expired`` error, and a dead letter for the operator.

The move is the job store's atomic transition, so any number of watchdogs (one per
postprocess worker, or the API process) may run at once; a short Redis lock also keeps
them from repeating each other's scan.

Finding candidates: job ids listed in the ``llmpipe:job-deadlines`` sorted set (score:
deadline) are checked when due, in O(due); ``JobStore.create`` indexes every job. Records
written by something else can be found by an incremental SCAN of ``llmpipe:job:*``
(``scan_count`` keys per tick, off by default).

:class:`Watchdog` is pure logic over Redis with an injectable clock (``tick`` does one
round); :class:`WatchdogLoop` runs it on a daemon thread, without Celery beat.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from llmpipe.jobs.store import DEADLINE_INDEX, JobStore
from llmpipe.messages import JobStatus
from llmpipe.settings import get_settings

log = logging.getLogger("llmpipe.jobs.watchdog")

INDEX_KEY = DEADLINE_INDEX
LOCK_KEY = "llmpipe:watchdog:lock"
_TERMINAL = {s.value for s in JobStatus if s.terminal}


def index_job(r_or_pipe: Any, job_id: str, deadline: float) -> None:
    """Register a job with the watchdog (call it where the job record is created)."""
    r_or_pipe.zadd(INDEX_KEY, {job_id: deadline})


def celery_meta_key(job_id: str) -> str:
    return f"celery-task-meta-{job_id}"


def _s(v: Any) -> str | None:
    return v.decode() if isinstance(v, bytes) else v


class Watchdog:
    def __init__(self, r: Any, store: JobStore | None = None, *, grace_s: float = 5.0, batch: int = 500,
                 scan_count: int = 0, clock: Callable[[], float] = time.time, deadletters: Any = None,
                 meta_key: Callable[[str], str] = celery_meta_key):
        self.r = r
        # The job records' TTL is the settings' (result_ttl_s), as every JobStore's.
        self.store = store if store is not None else JobStore(r, get_settings().result_ttl_s)
        self.grace_s = grace_s
        self.batch = batch
        self.scan_count = scan_count
        self._clock = clock
        self.deadletters = deadletters
        self._meta_key = meta_key
        self._cursor = 0
        self.settled: dict[str, int] = {}  # status -> count, for logs and tests

    # -- one round ---------------------------------------------------------------------
    def tick(self) -> int:
        """Settle every overdue job found this round; returns how many moved."""
        now = self._clock()
        cutoff = now - self.grace_s
        moved = 0
        due = self.r.zrangebyscore(INDEX_KEY, "-inf", cutoff, start=0, num=self.batch)
        for raw in due:
            job_id = _s(raw)
            moved += self.settle(job_id, now)
            self.r.zrem(INDEX_KEY, job_id)
        if self.scan_count > 0:
            # Off by default: JobStore.create indexes every job, and a SCAN of every
            # retained record per tick costs Redis work that grows with the result TTL.
            moved += self._scan_step(cutoff, now)
        return moved

    def _scan_step(self, cutoff: float, now: float) -> int:
        self._cursor, keys = self.r.scan(self._cursor, match="llmpipe:job:*", count=self.scan_count, _type="hash")
        if not keys:
            return 0
        pipe = self.r.pipeline(transaction=False)
        for k in keys:
            pipe.hmget(k, "status", "deadline")
        moved = 0
        for k, (status, deadline) in zip(keys, pipe.execute(), strict=True):
            status, deadline = _s(status), _s(deadline)
            if status is None or status in _TERMINAL or deadline is None:
                continue
            if float(deadline) <= cutoff:
                moved += self.settle(_s(k).removeprefix("llmpipe:job:"), now)
        return moved

    def settle(self, job_id: str, now: float | None = None) -> int:
        """Move one overdue job to its terminal status; 1 if it moved."""
        now = self._clock() if now is None else now
        rec = self.store.get(job_id)
        if rec is None or rec.status.terminal:
            return 0
        if rec.deadline + self.grace_s > now:
            return 0
        status, error, result = self._chord_outcome(job_id)
        if status is None:
            late = now - rec.deadline
            status = JobStatus.EXPIRED
            error = {"type": "expired", "message": f"the job did not finish by its deadline ({late:.1f}s ago); "
                     "a stage stopped consuming (a worker died?), so the watchdog expired it"}
        if not self.store.transition(job_id, status, error, now=now, result=result):
            return 0
        self.settled[status.value] = self.settled.get(status.value, 0) + 1
        log.warning("job=%s settled as %s by the watchdog (deadline passed %.1fs ago, was %s)",
                    job_id, status.value, now - rec.deadline, rec.status.value)
        if status is JobStatus.EXPIRED and self.deadletters is not None:
            self.deadletters.record(stage=None, reason="expired", message=error["message"], job_id=job_id,
                                    prompts=rec.n_prompts, was=rec.status.value)
        return 1

    def _chord_outcome(self, job_id: str) -> tuple[JobStatus | None, dict | None, str | None]:
        """(status, error, result JSON) from the chord's stored result: the job record
        lagged because the chord callback could not write it (Redis was away)."""
        raw = self.r.get(self._meta_key(job_id))
        if not raw:
            return None, None, None
        try:
            meta = json.loads(raw)
        except ValueError:
            return None, None, None
        state = meta.get("status")
        if state == "SUCCESS":
            result = meta.get("result") or {}
            error = result.get("error")
            if isinstance(error, dict) and "reason" in error:
                error = {"type": error["reason"], **{k: v for k, v in error.items() if k != "reason"}}
            try:
                status = JobStatus(result.get("status", "succeeded"))
            except ValueError:
                status, error = JobStatus.SUCCEEDED, None
            return status, error, json.dumps(result)
        if state == "FAILURE":
            res = meta.get("result") or {}
            msg = f"{res.get('exc_type', 'error')}: {res.get('exc_message', '')}" if isinstance(res, dict) else str(res)
            return JobStatus.FAILED, {"type": "internal_error", "message": msg}, None
        return None, None, None


class WatchdogLoop:
    """Runs ``watchdog.tick()`` every ``interval_s`` on a daemon thread until ``stop()``.

    Redis errors are logged and retried next round, so the loop survives a Redis
    restart. With ``lock=True`` a short Redis lock lets one of several loops tick per round.
    """

    def __init__(self, watchdog: Watchdog, interval_s: float = 2.0, *, lock: bool = True, name: str = "llmpipe-watchdog"):
        self.watchdog = watchdog
        self.interval_s = interval_s
        self.lock = lock
        self.ticks = 0
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> WatchdogLoop:
        self._thread.start()
        log.info("watchdog started (every %.1fs, grace %.1fs)", self.interval_s, self.watchdog.grace_s)
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                if self.lock and not self.watchdog.r.set(LOCK_KEY, 1, nx=True, px=max(1, int(self.interval_s * 900))):
                    continue
                self.watchdog.tick()
                self.ticks += 1
            except Exception as exc:
                self.errors += 1
                log.warning("watchdog round failed (%s: %s); retrying", type(exc).__name__, exc)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()
