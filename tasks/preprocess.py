from llmpipe.celery_app import app
from llmpipe.errors import CancelledError, ExpiredError, ModelNotFoundError
from llmpipe.messages import JobStatus, PromptRequest, Stage
from llmpipe.observability import metrics
from workers.context import context


@app.task(name="llmpipe.preprocess", ignore_result=True)
def preprocess(msg: dict) -> dict:
    req = PromptRequest.model_validate(msg)
    ctx = context()
    if req.error is None:
        # One step: the job moves to running, and a job that already ended (cancelled by
        # DELETE or a client that left, expired at the API) is not worked on.
        status = ctx.jobs.start(req.job_id)
        if status is not None and status.terminal:
            err = ExpiredError if status == JobStatus.EXPIRED else CancelledError
            req.error = err(f"job {status.value} before preprocess").to_stage_error(Stage.PREPROCESS)
    try:
        model = ctx.model(req.model)  # the request's model's tokenizer, loaded once per process
    except ModelNotFoundError as exc:  # this worker's settings serve other models than the API's
        req.error = req.error or exc.to_stage_error(Stage.PREPROCESS)
        model = ctx.model(None)  # passes the failed request on untouched
    out = model.input_processor.process(req)
    metrics.observe_stage(out.timings[-1], req.model or ctx.served.default.name)
    metrics.observe_error(out.error and out.error.reason.value, Stage.PREPROCESS.value)
    return out.model_dump(mode="json", exclude_none=True)  # absent fields (logprobs, echo...) stay out
