import time

from llmpipe import metrics
from llmpipe.admission import release
from llmpipe.celery_app import app
from llmpipe.processors.collector import collect_job, log_job
from workers.context import context


@app.task(name="llmpipe.collect")
def collect(results: list[dict], job_id: str, submitted_at: float | None = None) -> dict:
    """The chord callback: every prompt of the job, in order. Its return value, stored
    under the job id, is the job's result; the API reads it from there."""
    job = collect_job(job_id, results)
    release(context().redis, job_id)
    # The job is done: its requests' stored stage results (llmpipe/idempotency.py) are not needed.
    context().memo.forget(f"{job_id}-{r.index}" for r in job.results)
    e2e = max(0.0, time.time() - submitted_at) if submitted_at is not None else None
    if e2e is not None:
        metrics.E2E.observe(e2e)
    log_job(job, e2e)
    metrics.FINISHED.labels(job.status.value).inc()
    return job.model_dump(mode="json")
