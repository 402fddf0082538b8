"""PromptResult[] -> JobResult: the chord callback's logic (tasks/collect.py), and a job of
one prompt's last hop (tasks/postprocess.py)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

from llmpipe.broker.redis_clients import UNAVAILABLE_ERRORS
from llmpipe.messages import ErrorReason, JobResult, JobStatus, PromptResult, Stage, StageError, Usage
from llmpipe.observability import metrics
from llmpipe.processors.envelope import as_json

log = logging.getLogger("llmpipe.collect")
# The job's one INFO line belongs to the postprocess stage's log (issue 15: counts, never content).
job_log = logging.getLogger("llmpipe.postprocess")
_SHORT = {Stage.PREPROCESS: "pre", Stage.INFERENCE: "inf", Stage.POSTPROCESS: "post"}
_REDIS_ERRORS = UNAVAILABLE_ERRORS


def collect_job(job_id: str, results: list[dict]) -> JobResult:
    prompts = sorted((PromptResult.model_validate(r) for r in results), key=lambda r: r.index)
    usage = Usage(
        prompt_tokens=sum(p.prompt_tokens for p in prompts),
        completion_tokens=sum(p.completion_tokens for p in prompts),
    )
    usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
    errors = [p.error for p in prompts if p.error is not None]
    status, error = JobStatus.SUCCEEDED, None
    if errors:
        first = errors[0]
        status = {
            ErrorReason.EXPIRED: JobStatus.EXPIRED,
            ErrorReason.CANCELLED: JobStatus.CANCELLED,
        }.get(first.reason, JobStatus.FAILED)
        which = [p.index for p in prompts if p.error is not None]
        error = StageError(
            reason=first.reason,
            message=f"{len(errors)} of {len(prompts)} prompts failed (indexes {which}); first: {first.message}",
            stage=first.stage,
            param=first.param,
        )
    return JobResult(job_id=job_id, status=status, results=prompts, usage=usage, error=error)


class JobCollector:
    """The chord callback's work, without Celery: the job record takes the result and its
    terminal status in one step (the one source of truth; llmpipe/jobs/store.py), then the job's
    admission reservation and stage memos are freed.

    A Redis blip must not fail a job whose prompts all succeeded: the record write is
    retried with backoff for up to ``settle_for_s`` (if Redis stays away, the watchdog
    adopts the chord's stored result at the deadline), and the clean-ups only log, since
    the reservation ends at the deadline and the memos expire by themselves.
    """

    def __init__(self, store: Any, *, release: Callable[[str], Any], forget: Callable[[list[str]], Any],
                 settle_for_s: float = 10.0, sleep: Callable[[float], None] | None = None):
        self.store = store
        self._release = release
        self._forget = forget
        self.settle_for_s = settle_for_s
        self._sleep = sleep
        self.recorded = False  # whether the last collect wrote the job record (False: it had ended)

    def collect(self, job_id: str, results: list[dict]) -> JobResult:
        job = collect_job(job_id, results)
        self.recorded = self._settle(job)
        for what, step in (("admission release", lambda: self._release(job_id)),
                           ("memo clean-up", lambda: self._forget([f"{job_id}-{r.index}" for r in job.results]))):
            try:
                step()
            except Exception as exc:
                log.warning("job=%s stage=collect %s failed (%s: %s); it expires by itself",
                            job_id, what, type(exc).__name__, exc)
        return job

    def _settle(self, job: JobResult) -> bool:
        kwargs = {"sleep": self._sleep} if self._sleep is not None else {}
        retrying = Retrying(stop=stop_after_delay(self.settle_for_s), wait=wait_exponential(multiplier=0.1, max=2.0),
                            retry=retry_if_exception_type(_REDIS_ERRORS), reraise=True, **kwargs)
        try:
            moved = retrying(self.store.finish, job)
        except _REDIS_ERRORS as exc:
            log.error("job=%s stage=collect could not write the job record (%s); the watchdog settles it "
                      "from the chord result at its deadline", job.job_id, exc)
            return True  # the stored task result is what the watchdog adopts
        if not moved:
            log.info("job=%s stage=collect the job had already ended (cancelled, expired, or collected by an "
                     "earlier delivery); result not recorded", job.job_id)
        return bool(moved)


def log_job(job: JobResult, e2e_s: float | None = None) -> None:
    """The job's one INFO line: ids, counts and times, never its content. Per stage, the
    slowest prompt's queue wait and run time (seconds)."""
    if not job_log.isEnabledFor(logging.INFO):
        return
    stages = []
    for stage in Stage:
        t = [r.timings[stage] for r in job.results if stage in r.timings]
        if t:
            stages.append(f"{_SHORT[stage]}={max(x.queue_wait_s for x in t):.3f}/{max(x.run_s for x in t):.3f}")
    batch = max((r.batch_size for r in job.results), default=0)
    job_log.info("job=%s stage=postprocess status=%s prompts=%d tokens_in=%d tokens_out=%d batch=%d wait/run_s %s%s%s",
                 job.job_id, job.status.value, len(job.results), job.usage.prompt_tokens, job.usage.completion_tokens,
                 batch, " ".join(stages), "" if e2e_s is None else f" e2e_s={e2e_s:.3f}",
                 f" error={job.error.reason.value}" if job.error else "")


class JobFinisher:
    """A job's last hop: its prompts' results written to the job record (which the API
    reads), its reservation and memos freed (JobCollector), its metrics and its log line.
    Returns the job's result, which Celery also stores under the job id; only the watchdog
    reads that, when the record write failed.

    ``release``: frees the job's admission reservation (a no-op without admission limits:
    the API reserved nothing); ``forget``: drops the job's stage memos."""

    def __init__(self, store: Any, *, release: Callable[[str], Any], forget: Callable[[list[str]], Any],
                 default_model: str, clock: Callable[[], float] = time.time):
        self.store = store
        self._release = release
        self._forget = forget
        self.default_model = default_model
        self._clock = clock

    def finish(self, results: list[dict], job_id: str, submitted_at: float | None, model: str | None = None) -> dict:
        # One collector per job: its ``recorded`` is this job's (a threads pool runs several at once).
        collector = JobCollector(self.store, release=self._release, forget=self._forget)
        job = collector.collect(job_id, results)
        e2e = max(0.0, self._clock() - submitted_at) if submitted_at is not None else None
        if e2e is not None:
            metrics.E2E.labels(model or self.default_model).observe(e2e)
        log_job(job, e2e)
        metrics.FINISHED.labels(job.status.value).inc()
        if not collector.recorded:
            # Delivered again after the record took its result (or the job had ended): return
            # what the record holds, so the result stored under the job id never differs.
            stored = self.store.get(job_id)
            if stored is not None and stored.result_json:
                return json.loads(stored.result_json)
        return as_json(job)
