"""``llmpipe.preprocess``: PromptRequest -> TokenizedRequest (llmpipe/processors/cpu_stages.py)."""

from llmpipe.celery_app import app
from llmpipe.stages import Stage


@app.task(name=Stage.PREPROCESS.task, bind=True, ignore_result=True)
def preprocess(self, msg: dict) -> dict:
    return self.ctx.preprocess_stage.run(msg)
