from llmpipe.jobs.store import JobStore
from llmpipe.messages import JobStatus


def test_job_lifecycle_and_terminal_states_are_final(redis_client):
    store = JobStore(redis_client, ttl_s=60)
    store.create("a", n_prompts=2, deadline=123.0, now=100.0)
    rec = store.get("a")
    assert (rec.status, rec.n_prompts, rec.deadline, rec.created_at) == (JobStatus.QUEUED, 2, 123.0, 100.0)
    assert 0 < redis_client.ttl(store.key("a")) <= 60
    assert store.transition("a", JobStatus.RUNNING)
    assert not store.transition("a", JobStatus.RUNNING)  # only from queued
    assert store.transition("a", JobStatus.SUCCEEDED)
    assert not store.transition("a", JobStatus.FAILED, {"type": "x"})  # terminal is final
    assert store.get("a").status == JobStatus.SUCCEEDED


def test_unknown_job(redis_client):
    store = JobStore(redis_client, ttl_s=60)
    assert store.get("nope") is None
    assert not store.transition("nope", JobStatus.RUNNING)


def test_error_is_recorded(redis_client):
    store = JobStore(redis_client, ttl_s=60)
    store.create("b", n_prompts=1, deadline=1.0)
    store.transition("b", JobStatus.EXPIRED, {"type": "expired", "message": "late"})
    assert store.get("b").error == {"type": "expired", "message": "late"}


def _moves(redis_client, job_id):
    from llmpipe.jobs.store import done_channel

    ps = redis_client.pubsub(ignore_subscribe_messages=True)
    ps.subscribe(done_channel(job_id))
    assert ps.get_message(timeout=1) is None  # (the confirmation)
    return ps


def _result(job_id: str, text: str):
    from llmpipe.messages import JobResult

    return JobResult.model_validate({
        "job_id": job_id, "status": "succeeded", "results": [{"index": 0, "text": text, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


def test_a_terminal_move_publishes_itself_and_stands_for_the_record(redis_client):
    from llmpipe.jobs.store import parse_wake

    store = JobStore(redis_client, ttl_s=60)
    for job_id, move in (("ok", lambda: store.finish(_result("ok", "hi"), now=150.5)),
                         ("late", lambda: store.stop("late", JobStatus.EXPIRED, {"type": "expired", "message": "m"},
                                                     now=151.0))):
        store.create(job_id, n_prompts=1, deadline=123.0, now=100.0, meta={"model": "m"})
        before = store.get(job_id)
        ps = _moves(redis_client, job_id)
        assert move()
        wake = parse_wake(ps.get_message(timeout=2)["data"])
        assert wake["complete"] is True
        assert before.ended(wake) == store.get(job_id)  # what a long-poll builds is what the record holds
        assert not move()  # an ended job does not move again, nor publish
        assert ps.get_message(timeout=0.2) is None
        ps.close()


def test_a_result_too_long_for_the_wake_is_left_to_the_record(redis_client):
    from llmpipe.jobs.store import WAKE_RESULT_MAX, parse_wake

    store = JobStore(redis_client, ttl_s=60)
    store.create("big", n_prompts=1, deadline=123.0, now=100.0)
    before = store.get("big")
    ps = _moves(redis_client, "big")
    assert store.finish(_result("big", "x" * WAKE_RESULT_MAX))
    wake = parse_wake(ps.get_message(timeout=2)["data"])
    assert wake["status"] == "succeeded" and "result" not in wake and wake["complete"] is False
    assert before.ended(wake) is None
    assert store.get("big").result.results[0].text == "x" * WAKE_RESULT_MAX
    ps.close()


def test_only_a_terminal_move_of_this_version_stands_for_the_record(redis_client):
    from llmpipe.jobs.store import parse_wake

    store = JobStore(redis_client, ttl_s=60)
    store.create("c", n_prompts=1, deadline=123.0, now=100.0)
    rec = store.get("c")
    assert parse_wake(b"succeeded") is None  # an older publisher's plain status: read the record
    assert parse_wake(b"") is None and parse_wake(None) is None
    assert rec.ended({"status": "running", "updated_at": "1", "complete": True}) is None
    assert rec.ended({"status": "bogus", "updated_at": "1", "complete": True}) is None
