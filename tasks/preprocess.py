"""``llmpipe.preprocess``: PromptRequest -> TokenizedRequest (llmpipe/processors/cpu_stages.py)."""

from llmpipe.celery_app import app
from llmpipe.stages import Stage


@app.task(name=Stage.PREPROCESS.task, bind=True, ignore_result=True)
def preprocess(self, msg: dict) -> dict:
    # The stage may send the inference hop to one worker's own queue (llmpipe/routing/).
    return self.ctx.preprocess_stage.run(msg, send_next_to=self.send_next_to)
