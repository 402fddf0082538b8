import time

from llmpipe.celery_app import app
from llmpipe.jobs.admission import enabled, release
from llmpipe.observability import metrics
from llmpipe.processors.collector import JobCollector, log_job
from workers.context import context


@app.task(name="llmpipe.collect")
def collect(results: list[dict], job_id: str, submitted_at: float | None = None, model: str | None = None) -> dict:
    """The chord callback of a job of several prompts: every prompt of the job, in order,
    written to the job record (which the API reads). Celery also stores the return value
    under the job id; only the watchdog reads that, when the record write failed. (A job of
    one prompt has no chord: its postprocess task does this, tasks/postprocess.py.)"""
    return finish_job(results, job_id, submitted_at, model)


def finish_job(results: list[dict], job_id: str, submitted_at: float | None, model: str | None = None) -> dict:
    ctx = context()
    s = ctx.settings
    # Without admission limits the API reserved nothing (llmpipe/jobs/admission.py).
    admitted = enabled(s.max_queue_depth, s.max_queued_prompt_tokens)
    collector = JobCollector(ctx.jobs, release=lambda j: release(ctx.redis, j) if admitted else None,
                             forget=ctx.memo.forget)
    job = collector.collect(job_id, results)
    e2e = max(0.0, time.time() - submitted_at) if submitted_at is not None else None
    if e2e is not None:
        metrics.E2E.labels(model or s.served.default.name).observe(e2e)
    log_job(job, e2e)
    metrics.FINISHED.labels(job.status.value).inc()
    if not collector.recorded:
        # Delivered again after the record took its result (or the job had ended): return
        # what the record holds, so the result stored under the job id never differs.
        stored = ctx.jobs.get(job_id)
        if stored is not None and stored.result_json:
            import json

            return json.loads(stored.result_json)
    return job.model_dump(mode="json", exclude_none=True)  # absent fields (logprobs, echo...) stay out
