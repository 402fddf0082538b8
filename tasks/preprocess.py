from llmpipe.celery_app import app
from llmpipe.messages import JobStatus, PromptRequest
from workers.context import context


@app.task(name="llmpipe.preprocess", ignore_result=True)
def preprocess(msg: dict) -> dict:
    req = PromptRequest.model_validate(msg)
    ctx = context()
    if req.index == 0:
        ctx.jobs.transition(req.job_id, JobStatus.RUNNING)
    return ctx.input_processor.process(req).model_dump(mode="json")
