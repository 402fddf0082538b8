from llmpipe import metrics
from llmpipe.celery_app import app
from llmpipe.messages import Generation, Stage
from workers.context import context


@app.task(name="llmpipe.postprocess")
def postprocess(msg: dict) -> dict:
    gen = Generation.model_validate(msg)
    # Idempotent by request id: a redelivered message returns the first run's result.
    value, _ = context().memo.run(Stage.POSTPROCESS.value, gen.request_id, gen.deadline, lambda: _post(gen))
    return value


def _post(gen: Generation) -> dict:
    result = context().output_processor.process(gen)
    t = result.timings[Stage.POSTPROCESS]
    metrics.observe_stage_times(Stage.POSTPROCESS.value, t.queue_wait_s, t.run_s)
    if gen.first_token_at is not None and gen.timings:
        metrics.TTFT.observe(max(0.0, gen.first_token_at - gen.timings[0].enqueued_at))
    return result.model_dump(mode="json", exclude_none=True)  # absent fields (logprobs, echo...) stay out
