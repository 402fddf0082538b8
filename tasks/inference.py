from llmpipe.celery_app import app
from llmpipe.jobs.memo import DELIVERY
from llmpipe.messages import ErrorReason, Stage, StageError, TokenizedRequest
from llmpipe.observability import metrics
from workers.context import context


@app.task(name="llmpipe.inference", ignore_result=True)
def inference(msg: dict) -> dict:
    # Runs on a threads pool: each thread waits here while the process's one batcher
    # runs its request with others through the engine.
    req = TokenizedRequest.model_validate(msg)
    if req.error is not None:
        return _infer(req)
    # Idempotent by request id: a redelivered or duplicated message returns the result
    # stored by the first run instead of running the engine again (llmpipe/jobs/memo.py).
    value, _ = context().memo.run(Stage.INFERENCE.value, req.request_id, req.deadline, lambda: _infer(req),
                                  over_limit=lambda n: _over_limit(req, n))
    return value


def _infer(req: TokenizedRequest) -> dict:
    # A redelivered message (its worker died) continues from the tokens its first delivery
    # streamed, so a client never sees text that the result then contradicts.
    out = context().inference().process(req, resume=DELIVERY.get() > 1)
    metrics.observe_stage(out.timings[-1], context().own_model.name)
    if out.error is not None and req.error is None:
        metrics.observe_error(out.error.reason.value, Stage.INFERENCE.value)
        if out.error.reason == ErrorReason.ENGINE_ERROR:  # failed for good, after isolation and retries
            context().deadletters.record(stage=Stage.INFERENCE.value, reason=out.error.reason.value,
                                         message=out.error.message, job_id=req.job_id, request_id=req.request_id,
                                         prompt_tokens=len(req.prompt_token_ids))
    return out.model_dump(mode="json", exclude_none=True)  # absent fields (logprobs, echo...) stay out


def _over_limit(req: TokenizedRequest, deliveries: int) -> dict:
    """A request whose worker died on each of its deliveries (it kills the engine): stop."""
    from llmpipe.processors.inference_processor import InferenceProcessor

    message = (f"the request was delivered {deliveries} times and its worker was lost each time "
               f"(max_deliveries={context().settings.max_deliveries}); it was not run again")
    context().deadletters.record(stage=Stage.INFERENCE.value, reason="max_deliveries", message=message,
                                 job_id=req.job_id, request_id=req.request_id, deliveries=deliveries)
    err = StageError(reason=ErrorReason.ENGINE_ERROR, message=message, stage=Stage.INFERENCE)
    return InferenceProcessor._failed(req, err).model_copy(update={"timings": req.timings}).model_dump(mode="json", exclude_none=True)
