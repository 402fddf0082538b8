"""PromptResult[] -> JobResult: the chord callback's logic."""

from __future__ import annotations

import logging

from llmpipe.messages import ErrorReason, JobResult, JobStatus, PromptResult, Stage, StageError, Usage

log = logging.getLogger("llmpipe.postprocess")
_SHORT = {Stage.PREPROCESS: "pre", Stage.INFERENCE: "inf", Stage.POSTPROCESS: "post"}


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


def log_job(job: JobResult, e2e_s: float | None = None) -> None:
    """The job's one INFO line: ids, counts and times, never its content. Per stage, the
    slowest prompt's queue wait and run time (seconds)."""
    if not log.isEnabledFor(logging.INFO):
        return
    stages = []
    for stage in Stage:
        t = [r.timings[stage] for r in job.results if stage in r.timings]
        if t:
            stages.append(f"{_SHORT[stage]}={max(x.queue_wait_s for x in t):.3f}/{max(x.run_s for x in t):.3f}")
    batch = max((r.batch_size for r in job.results), default=0)
    log.info("job=%s stage=postprocess status=%s prompts=%d tokens_in=%d tokens_out=%d batch=%d wait/run_s %s%s%s",
             job.job_id, job.status.value, len(job.results), job.usage.prompt_tokens, job.usage.completion_tokens, batch,
             " ".join(stages), "" if e2e_s is None else f" e2e_s={e2e_s:.3f}",
             f" error={job.error.reason.value}" if job.error else "")
