from llmpipe import metrics
from llmpipe.cancel import cancelled
from llmpipe.celery_app import app
from llmpipe.errors import CancelledError
from llmpipe.messages import JobStatus, PromptRequest, Stage
from workers.context import context


@app.task(name="llmpipe.preprocess", ignore_result=True)
def preprocess(msg: dict) -> dict:
    req = PromptRequest.model_validate(msg)
    ctx = context()
    if req.error is None and cancelled(ctx.redis, [req.job_id]):
        req.error = CancelledError("job cancelled before preprocess").to_stage_error(Stage.PREPROCESS)
    elif req.index == 0:
        ctx.jobs.transition(req.job_id, JobStatus.RUNNING)
    out = ctx.input_processor.process(req)
    metrics.observe_stage(out.timings[-1])
    metrics.observe_error(out.error and out.error.reason.value, Stage.PREPROCESS.value)
    return out.model_dump(mode="json", exclude_none=True)  # absent fields (logprobs, echo...) stay out
