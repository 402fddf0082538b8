"""``llmpipe.postprocess``: Generation -> PromptResult; for a job of one prompt (``job_id``
given) also its last hop, which collects it (llmpipe/processors/cpu_stages.py)."""

from llmpipe.celery_app import app
from llmpipe.stages import Stage


@app.task(name=Stage.POSTPROCESS.task, bind=True)
def postprocess(self, msg: dict, job_id: str | None = None, submitted_at: float | None = None,
                model: str | None = None) -> dict:
    return self.ctx.postprocess_stage.run(msg, job_id, submitted_at, model)
