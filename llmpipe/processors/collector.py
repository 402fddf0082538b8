"""PromptResult[] -> JobResult: the chord callback's logic."""

from __future__ import annotations

from llmpipe.messages import ErrorReason, JobResult, JobStatus, PromptResult, StageError, Usage


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
        )
    return JobResult(job_id=job_id, status=status, results=prompts, usage=usage, error=error)
