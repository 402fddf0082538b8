from llmpipe.celery_app import app
from llmpipe.processors.collector import collect_job


@app.task(name="llmpipe.collect")
def collect(results: list[dict], job_id: str) -> dict:
    """The chord callback: every prompt of the job, in order. Its return value, stored
    under the job id, is the job's result; the API reads it from there."""
    return collect_job(job_id, results).model_dump(mode="json")
