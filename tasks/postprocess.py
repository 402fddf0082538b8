from llmpipe.celery_app import app
from llmpipe.messages import Generation, Stage
from llmpipe.observability import metrics
from workers.context import context


@app.task(name="llmpipe.postprocess")
def postprocess(msg: dict, job_id: str | None = None, submitted_at: float | None = None, model: str | None = None) -> dict:
    gen = Generation.model_validate(msg)
    if job_id is not None:
        # A job of one prompt is one chain, no chord: this task is its last hop and collects
        # it (its task id is the job id, so its stored result is where the chord's would be).
        # No memo: detokenizing is deterministic, the record's first terminal write wins, and a
        # redelivery returns what the record holds (tasks/collect.py).
        from tasks.collect import finish_job

        return finish_job([_post(gen)], job_id, submitted_at, model)
    # Idempotent by request id: a redelivered message returns the first run's result.
    value, _ = context().memo.run(Stage.POSTPROCESS.value, gen.request_id, gen.deadline, lambda: _post(gen))
    return value


def _post(gen: Generation) -> dict:
    ctx = context()
    result = ctx.model(gen.model).output_processor.process(gen)  # the request's model's tokenizer
    model = gen.model or ctx.served.default.name
    t = result.timings[Stage.POSTPROCESS]
    metrics.observe_stage_times(Stage.POSTPROCESS.value, t.queue_wait_s, t.run_s, model)
    if gen.first_token_at is not None and gen.timings:
        metrics.TTFT.labels(model).observe(max(0.0, gen.first_token_at - gen.timings[0].enqueued_at))
    return result.model_dump(mode="json", exclude_none=True)  # absent fields (logprobs, echo...) stay out
