from llmpipe.jobs import JobStore
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
