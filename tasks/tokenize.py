"""``llmpipe.tokenize``: ``POST /tokenize``, answered on the preprocess queue (llmpipe/processors/cpu_stages.py)."""

from llmpipe.celery_app import app
from llmpipe.stages import TOKENIZE_TASK


@app.task(name=TOKENIZE_TASK, bind=True)
def tokenize(self, body: dict) -> dict:
    return self.ctx.tokenize_stage.run(body)
