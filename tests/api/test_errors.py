"""The one error -> HTTP mapping: a table, retry advice on every error, final failures
that no client retries. Real Redis, no workers: the tests end jobs as collect would."""

from __future__ import annotations

import json
import threading

import pytest
from fastapi.testclient import TestClient

from api.errors import ERROR_RESPONSES, ERROR_TABLE, RETRY_HEADER, mapping_for
from llmpipe.messages import ErrorReason
from llmpipe.settings import Settings

# What the openai client and generic HTTP clients retry on their defaults.
CLIENT_RETRIES = {408, 409, 429} | set(range(500, 600))


def test_every_reason_has_one_status_and_final_ones_are_not_retried():
    assert {r.reason for r in ERROR_TABLE} == set(ErrorReason)
    assert {r.reason for r in ERROR_TABLE if r.retry} == {
        ErrorReason.OVERLOADED, ErrorReason.UNAVAILABLE, ErrorReason.IDEMPOTENCY_KEY_IN_USE}
    # A final failure never gets a status that clients retry by default, except where only
    # a server-side status is honest (500, 504) or the client itself cancelled (409): there
    # x-should-retry: false says no.
    for row in ERROR_TABLE:
        if not row.retry:
            assert row.status not in CLIENT_RETRIES or row.status in (409, 500, 504), row
    assert mapping_for(ErrorReason.ENGINE_ERROR).status == 424
    assert mapping_for(ErrorReason.EXPIRED).status == 504
    assert set(ERROR_RESPONSES) == {r.status for r in ERROR_TABLE}


@pytest.fixture
def client(redis_client, redis_url, tmp_path, tiny_model):
    from api.app import create_app

    s = Settings(redis_url=redis_url, state_dir=tmp_path, model=tiny_model)
    with TestClient(create_app(s)) as c:
        yield c


def _waiting_call(client, redis_client, helpers, body):
    """Start a non-streaming call in a thread; return (job id, the thread's result holder)."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", client.post("/v1/completions", json=body)))
    t.start()
    assert helpers.wait_for(lambda: redis_client.llen("preprocess") == 1)
    job_id = next(iter(redis_client.scan_iter("llmpipe:job:*"))).decode().removeprefix("llmpipe:job:")
    assert helpers.wait_for(lambda: helpers.waiting(client.app.state.waiter, redis_client, job_id) == 1)
    return job_id, t, out


def test_engine_failure_is_424_and_final(client, redis_client, helpers):
    job_id, t, out = _waiting_call(client, redis_client, helpers, {"prompt": "x", "max_tokens": 2})
    helpers.finish_job(redis_client, job_id, error={"reason": "engine_error", "message": "poison", "stage": "inference"})
    t.join(10)
    r = out["r"]
    assert r.status_code == 424 and r.headers[RETRY_HEADER] == "false"
    assert r.json()["error"] == {"type": "engine_error", "message": "poison", "param": None, "code": 424}


def test_a_cancelled_job_is_409_and_final(client, redis_client, helpers):
    job_id, t, out = _waiting_call(client, redis_client, helpers, {"prompt": "x", "max_tokens": 2})
    assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
    t.join(10)
    assert out["r"].status_code == 409 and out["r"].headers[RETRY_HEADER] == "false"


def test_a_passed_deadline_is_504_and_final(client, redis_client):
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "timeout": 0.05})
    assert r.status_code == 504 and r.headers[RETRY_HEADER] == "false"
    assert r.json()["error"]["type"] == "expired"
    job_id = next(iter(redis_client.scan_iter("llmpipe:job:*"))).decode().removeprefix("llmpipe:job:")
    assert client.get(f"/v1/jobs/{job_id}").json()["status"] == "expired"
    assert redis_client.exists(f"llmpipe:cancelled:{job_id}")  # the workers drop its work


def test_client_errors_say_do_not_retry_and_overload_says_retry(client, redis_client):
    r = client.post("/v1/jobs", json={"prompt": ""})
    assert r.status_code == 422 and r.headers[RETRY_HEADER] == "false"
    assert client.get("/v1/jobs/nope").headers[RETRY_HEADER] == "false"


def test_a_stream_that_fails_sends_the_error_schema_with_param(client, redis_client, helpers):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        first = json.loads(next(ln for ln in lines if ln.startswith("data: "))[6:])
        job_id = first["id"].removeprefix("chatcmpl-")
        assert helpers.wait_for(lambda: helpers.waiting(client.app.state.waiter, redis_client, job_id) == 1)
        helpers.finish_job(redis_client, job_id, error={"reason": "engine_error", "message": "poison"})
        events = [ln[6:] for ln in lines if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2]) == {"error": {"type": "engine_error", "message": "poison", "param": None, "code": 424}}
