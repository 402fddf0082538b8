import time

from llmpipe import metrics
from llmpipe.admission import release
from llmpipe.celery_app import app
from llmpipe.processors.collector import JobCollector, log_job
from workers.context import context


@app.task(name="llmpipe.collect")
def collect(results: list[dict], job_id: str, submitted_at: float | None = None) -> dict:
    """The chord callback: every prompt of the job, in order, written to the job record
    (which the API reads). Celery also stores the return value under the job id; only the
    watchdog reads that, when the record write failed."""
    ctx = context()
    job = JobCollector(ctx.jobs, release=lambda j: release(ctx.redis, j), forget=ctx.memo.forget).collect(job_id, results)
    e2e = max(0.0, time.time() - submitted_at) if submitted_at is not None else None
    if e2e is not None:
        metrics.E2E.observe(e2e)
    log_job(job, e2e)
    metrics.FINISHED.labels(job.status.value).inc()
    return job.model_dump(mode="json", exclude_none=True)  # absent fields (logprobs, echo...) stay out
