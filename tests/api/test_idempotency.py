"""Idempotency-Key and the retry headers, against a real Redis with no workers."""

from __future__ import annotations

import threading

import pytest
from fastapi.testclient import TestClient

from llmpipe.settings import Settings


@pytest.fixture
def client(redis_client, redis_url, tmp_path):
    from api.app import create_app

    s = Settings(redis_url=redis_url, state_dir=tmp_path, api_keys="k1,k2", max_queue_depth=5)
    with TestClient(create_app(s)) as c:
        yield c


def _auth(key="k1", idem=None):
    h = {"Authorization": f"Bearer {key}"}
    if idem is not None:
        h["Idempotency-Key"] = idem
    return h


def _queued(r) -> int:
    return r.llen("preprocess")


def test_a_retried_post_with_the_same_key_gets_the_same_job(client, redis_client):
    body = {"prompt": "x", "max_tokens": 3}
    first = client.post("/v1/jobs", json=body, headers=_auth(idem="a-1"))
    again = client.post("/v1/jobs", json=body, headers=_auth(idem="a-1"))
    assert first.status_code == again.status_code == 202
    assert again.json()["id"] == first.json()["id"] and again.headers["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in first.headers
    assert _queued(redis_client) == 1  # one job was enqueued, not two
    # another key, or another API key with the same key, is another job
    assert client.post("/v1/jobs", json=body, headers=_auth(idem="a-2")).json()["id"] != first.json()["id"]
    assert client.post("/v1/jobs", json=body, headers=_auth("k2", idem="a-1")).json()["id"] != first.json()["id"]
    assert _queued(redis_client) == 3


def test_the_same_key_with_another_body_is_422(client, redis_client):
    assert client.post("/v1/jobs", json={"prompt": "x"}, headers=_auth(idem="b")).status_code == 202
    r = client.post("/v1/jobs", json={"prompt": "y"}, headers=_auth(idem="b"))
    assert r.status_code == 422 and r.headers["x-should-retry"] == "false"
    assert r.json()["error"] == {"type": "idempotency_key_reused", "param": "Idempotency-Key", "code": 422,
                                 "message": "Idempotency-Key 'b' was already used with a different request body; use a new key"}
    assert _queued(redis_client) == 1


def test_a_bad_key_is_400(client):
    r = client.post("/v1/jobs", json={"prompt": "x"}, headers=_auth(idem="k" * 300))
    assert r.status_code == 400 and r.json()["error"]["param"] == "Idempotency-Key"


def test_a_rejected_request_does_not_keep_its_key(client, redis_client):
    """429: no job was made, so the retry with the same key is admitted anew."""
    for _ in range(5):
        assert client.post("/v1/jobs", json={"prompt": "fill"}, headers=_auth()).status_code == 202
    r = client.post("/v1/jobs", json={"prompt": "x"}, headers=_auth(idem="c"))
    assert r.status_code == 429 and r.headers["x-should-retry"] == "true" and int(r.headers["Retry-After"]) >= 1
    redis_client.delete("preprocess")  # the queue drains
    r = client.post("/v1/jobs", json={"prompt": "x"}, headers=_auth(idem="c"))
    assert r.status_code == 202 and "Idempotent-Replayed" not in r.headers


def test_a_retry_waits_on_the_job_of_the_first_attempt(client, redis_client, helpers):
    """Two attempts of one non-streaming OpenAI request (the first one still waiting): one
    job, and both get its answer."""
    body = {"prompt": "hello", "max_tokens": 2}
    out = [None, None]

    def call(i):
        out[i] = client.post("/v1/completions", json=body, headers=_auth(idem="d"))

    t0 = threading.Thread(target=call, args=(0,))
    t0.start()
    assert helpers.wait_for(lambda: redis_client.llen("preprocess") == 1)
    job_id = next(iter(redis_client.scan_iter("llmpipe:job:*"))).decode().removeprefix("llmpipe:job:")
    t1 = threading.Thread(target=call, args=(1,))
    t1.start()
    assert helpers.wait_for(lambda: helpers.waiting(client.app.state.waiter, redis_client, job_id) == 2 and
                     redis_client.hget(f"llmpipe:job:{job_id}", "waiters") == b"2")
    helpers.finish_job(redis_client, job_id, text=" world")
    t0.join(10)
    t1.join(10)
    assert [r.status_code for r in out] == [200, 200]
    assert out[0].json()["id"] == out[1].json()["id"] == f"cmpl-{job_id}"
    assert out[1].json()["choices"][0]["text"] == " world"
    assert redis_client.llen("preprocess") == 1


def test_a_key_whose_clients_all_left_makes_a_new_job(client, redis_client):
    """The job of a request whose client disconnected was cancelled and will never be read:
    its key moves to a new job rather than answering the retry with 'cancelled'."""
    from llmpipe.jobs.store import JobStore

    r = client.post("/v1/jobs", json={"prompt": "x"}, headers=_auth(idem="e"))
    job_id = r.json()["id"]
    assert JobStore(redis_client, 60).abandon(job_id) == 1  # what a disconnect does
    r = client.post("/v1/jobs", json={"prompt": "x"}, headers=_auth(idem="e"))
    assert r.status_code == 202 and r.json()["id"] != job_id


def test_a_second_attempt_while_the_first_is_being_admitted_is_409_retryable(redis_url, redis_client):
    from api.request_keys import IdempotencyKeyInUse, RequestKeys, request_key

    keys = RequestKeys(redis_client, ttl_s=60, wait_s=0.05, sleep=lambda s: None)
    key = request_key("f", api_key=None, path="/v1/jobs", body={"prompt": "x"})
    assert not keys.claim(key, "job-1", attach=False).existing  # the record is not made yet
    with pytest.raises(IdempotencyKeyInUse):
        keys.claim(key, "job-2", attach=False)
    keys.release(key, "job-1")
    assert keys.claim(key, "job-3", attach=False).job_id == "job-3"
    assert 0 < redis_client.ttl(key.redis_key) <= 30  # a claim without a job does not pin the key
