from llmpipe import metrics
from llmpipe.celery_app import app
from llmpipe.messages import Stage, TokenizedRequest
from workers.context import context


@app.task(name="llmpipe.inference", ignore_result=True)
def inference(msg: dict) -> dict:
    # Runs on a threads pool: each thread waits here while the process's one batcher
    # runs its request with others through the engine.
    req = TokenizedRequest.model_validate(msg)
    out = context().inference().process(req)
    metrics.observe_stage(out.timings[-1])
    if out.error is not None and req.error is None:
        metrics.observe_error(out.error.reason.value, Stage.INFERENCE.value)
    return out.model_dump(mode="json")
