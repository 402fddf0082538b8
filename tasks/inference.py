"""``llmpipe.inference``: TokenizedRequest -> Generation, batched with the other requests in
flight on this worker (llmpipe/processors/inference_stage.py)."""

from llmpipe.celery_app import app
from llmpipe.stages import Stage


@app.task(name=Stage.INFERENCE.task, bind=True, ignore_result=True)
def inference(self, msg: dict) -> dict:
    return self.ctx.inference_stage.run(msg)
