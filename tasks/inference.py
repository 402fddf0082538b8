from llmpipe.celery_app import app
from llmpipe.messages import TokenizedRequest
from workers.context import context


@app.task(name="llmpipe.inference", ignore_result=True)
def inference(msg: dict) -> dict:
    # Runs on a threads pool: each thread waits here while the process's one batcher
    # runs its request with others through the engine.
    req = TokenizedRequest.model_validate(msg)
    return context().inference().process(req).model_dump(mode="json")
