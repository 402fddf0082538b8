"""``llmpipe.collect``: the chord callback of a job of several prompts (llmpipe/processors/collector.py)."""

from llmpipe.celery_app import app
from llmpipe.stages import COLLECT_TASK


@app.task(name=COLLECT_TASK, bind=True)
def collect(self, results: list[dict], job_id: str, submitted_at: float | None = None, model: str | None = None) -> dict:
    """Every prompt of the job, in order, written to the job record (which the API reads).
    Celery also stores the return value under the job id; only the watchdog reads that,
    when the record write failed. (A job of one prompt has no chord: its postprocess task
    does this, tasks/postprocess.py.)"""
    return self.ctx.finisher.finish(results, job_id, submitted_at, model)
