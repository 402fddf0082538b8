from llmpipe.celery_app import app
from llmpipe.processors.collector import collect_job
from workers.context import context


@app.task(name="llmpipe.collect")
def collect(results: list[dict], job_id: str) -> dict:
    """The chord callback: every prompt of the job, in order."""
    job = collect_job(job_id, results)
    context().jobs.transition(job_id, job.status, job.error.model_dump(mode="json") if job.error else None)
    return job.model_dump(mode="json")
