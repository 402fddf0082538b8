from llmpipe.messages import ErrorReason, FinishReason, JobStatus, PromptResult, StageError
from llmpipe.processors.collector import collect_job


def _res(i, error=None):
    return PromptResult(index=i, text=f"t{i}", token_ids=[i], prompt_tokens=3, completion_tokens=1,
                        finish_reason=FinishReason.ERROR if error else FinishReason.STOP, error=error).model_dump(mode="json")


def test_results_come_back_in_index_order_with_usage():
    job = collect_job("j", [_res(2), _res(0), _res(1)])
    assert [r.index for r in job.results] == [0, 1, 2]
    assert job.status == JobStatus.SUCCEEDED and job.error is None
    assert (job.usage.prompt_tokens, job.usage.completion_tokens, job.usage.total_tokens) == (9, 3, 12)


def test_one_failed_prompt_fails_the_job_but_keeps_the_others():
    err = StageError(reason=ErrorReason.CONTEXT_LENGTH_EXCEEDED, message="too long")
    job = collect_job("j", [_res(0), _res(1, err)])
    assert job.status == JobStatus.FAILED
    assert job.results[0].text == "t0"
    assert "1 of 2 prompts failed (indexes [1])" in job.error.message
    assert job.error.reason == ErrorReason.CONTEXT_LENGTH_EXCEEDED


def test_expired_prompt_expires_the_job():
    err = StageError(reason=ErrorReason.EXPIRED, message="late")
    assert collect_job("j", [_res(0, err)]).status == JobStatus.EXPIRED


def test_one_info_line_per_job_with_counts_and_stage_times_but_no_text(caplog):
    import logging

    from llmpipe.messages import Stage, StageTimingSummary
    from llmpipe.processors.collector import log_job

    results = []
    for i in range(2):
        r = PromptResult.model_validate(_res(i))
        r.timings = {Stage.PREPROCESS: StageTimingSummary(queue_wait_s=0.01 * (i + 1), run_s=0.002),
                     Stage.INFERENCE: StageTimingSummary(queue_wait_s=0.003, run_s=0.5 + i)}
        results.append(r.model_dump(mode="json"))
    job = collect_job("j42", results)
    with caplog.at_level(logging.INFO, logger="llmpipe.postprocess"):
        log_job(job, 1.75)
    (rec,) = caplog.records
    line = rec.getMessage()
    assert line == ("job=j42 stage=postprocess status=succeeded prompts=2 tokens_in=6 tokens_out=2 batch=0 "
                    "wait/run_s pre=0.020/0.002 inf=0.003/1.500 e2e_s=1.750")
    assert "t0" not in line and "t1" not in line  # the prompts' text


# -- JobCollector: the job record takes the result; clean-ups never fail the job ------------
def test_collecting_writes_the_result_to_the_record_even_when_clean_ups_fail(redis_client):
    import redis

    from llmpipe.jobs.store import JobStore
    from llmpipe.processors.collector import JobCollector

    store = JobStore(redis_client, 60)
    store.create("j", n_prompts=2, deadline=2e9)

    def release(job_id):  # the Redis blip of the issue: release() failed the job
        raise redis.exceptions.ConnectionError("blip")

    def forget(ids):
        raise redis.exceptions.TimeoutError("blip")

    job = JobCollector(store, release=release, forget=forget).collect("j", [_res(1), _res(0)])
    assert job.status == JobStatus.SUCCEEDED
    rec = store.get("j")
    assert rec.status == JobStatus.SUCCEEDED and [r.text for r in rec.result.results] == ["t0", "t1"]


def test_collecting_retries_the_record_write_through_a_blip(redis_client):
    import redis

    from llmpipe.jobs.store import JobStore
    from llmpipe.processors.collector import JobCollector

    store = JobStore(redis_client, 60)
    store.create("j", n_prompts=1, deadline=2e9)
    calls = []

    class Flaky:
        def finish(self, result):
            calls.append(1)
            if len(calls) < 3:
                raise redis.exceptions.ConnectionError("down")
            return store.finish(result)

    waits = []
    JobCollector(Flaky(), release=lambda j: None, forget=lambda ids: None, sleep=waits.append).collect("j", [_res(0)])
    assert len(calls) == 3 and len(waits) == 2
    assert store.get("j").status == JobStatus.SUCCEEDED


def test_a_failed_prompt_is_recorded_with_its_error_type(redis_client):
    from llmpipe.jobs.store import JobStore
    from llmpipe.processors.collector import JobCollector

    store = JobStore(redis_client, 60)
    store.create("j", n_prompts=1, deadline=2e9)
    err = StageError(reason=ErrorReason.ENGINE_ERROR, message="poison", stage="inference")
    JobCollector(store, release=lambda j: None, forget=lambda ids: None).collect("j", [_res(0, err)])
    rec = store.get("j")
    assert rec.status == JobStatus.FAILED
    assert rec.error["type"] == "engine_error" and rec.error["stage"] == "inference"


def test_the_finisher_records_the_job_frees_it_and_returns_the_recorded_result_on_a_redelivery(redis_client):
    import json

    from llmpipe.jobs.store import JobStore
    from llmpipe.processors.collector import JobFinisher

    jobs = JobStore(redis_client, 60)
    released, forgotten = [], []
    finisher = JobFinisher(jobs, release=released.append, forget=forgotten.extend, default_model="tiny",
                           clock=lambda: 101.0)
    jobs.create("fin", n_prompts=2, deadline=1e12, now=100.0)
    first = finisher.finish([_res(1), _res(0)], "fin", submitted_at=100.0)
    assert [r["index"] for r in first["results"]] == [0, 1] and first["status"] == "succeeded"
    assert json.loads(jobs.get("fin").result_json) == first
    assert released == ["fin"] and forgotten == ["fin-0", "fin-1"]
    # Delivered again after the record took its result: the record's result, not a new one.
    again = finisher.finish([_res(0)], "fin", submitted_at=100.0)
    assert again == first
