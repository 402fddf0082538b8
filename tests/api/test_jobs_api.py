"""The job API against a real Redis, with no workers: what it enqueues and reports."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import pytest
from fastapi.testclient import TestClient

from llmpipe.settings import Settings


@pytest.fixture
def client(redis_client, redis_url, tmp_path):
    from api.app import create_app

    s = Settings(redis_url=redis_url, state_dir=tmp_path, max_prompts_per_job=4, max_tokens_limit=100)
    with TestClient(create_app(s)) as c:
        yield c


def _queued_messages(r, queue="preprocess"):
    return [json.loads(m) for m in r.lrange(queue, 0, -1)]


def test_post_enqueues_one_chain_per_prompt_by_task_name(client, redis_client):
    r = client.post("/v1/jobs", json={"prompts": ["a", "b", "c"], "max_tokens": 5, "temperature": 0})
    assert r.status_code == 202
    job_id = r.json()["id"]
    assert r.json()["status_url"] == f"/v1/jobs/{job_id}"
    msgs = _queued_messages(redis_client)
    assert len(msgs) == 3
    assert {m["headers"]["task"] for m in msgs} == {"llmpipe.preprocess"}
    assert all(m["content-type"] == "application/json" for m in msgs)
    view = client.get(f"/v1/jobs/{job_id}").json()
    assert view["status"] == "queued" and view["prompts"] == 3 and view["result"] is None


def test_api_keeps_no_pubsub_subscriptions(client, redis_client):
    for _ in range(20):
        assert client.post("/v1/jobs", json={"prompt": "x"}).status_code == 202
    assert redis_client.pubsub_channels() == []


def test_unknown_id_404_with_error_schema(client):
    r = client.get("/v1/jobs/does-not-exist")
    assert r.status_code == 404
    assert r.json() == {"error": {"type": "not_found", "message": "no job with id 'does-not-exist' (unknown or expired)",
                                  "param": "id", "code": 404}}


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "bogus": 1}, "bogus"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"prompt": ""}, "prompt"),
    ],
)
def test_invalid_body_is_422_naming_the_field(client, body, param):
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == 422
    assert r.json()["error"]["type"] == "invalid_request"
    assert r.json()["error"]["param"] == param


def test_limits_are_400_and_name_the_limit(client):
    r = client.post("/v1/jobs", json={"prompts": ["a"] * 5})
    assert r.status_code == 400 and "max_prompts_per_job" in r.json()["error"]["message"]
    r = client.post("/v1/jobs", json={"prompt": "a", "max_tokens": 101})
    assert r.status_code == 400 and "max_tokens_limit" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "limit_exceeded"


def test_redis_outage_is_503(tmp_path):
    from api.app import create_app
    from llmpipe.local.redis_server import free_port

    s = Settings(redis_url=f"redis://127.0.0.1:{free_port()}/0", state_dir=tmp_path)
    with TestClient(create_app(s)) as c:
        r = c.get("/v1/jobs/abc")
        assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable"
        r = c.post("/v1/jobs", json={"prompt": "x"})
        assert r.status_code == 503
        assert c.get("/healthz").status_code == 503


def test_api_imports_neither_torch_nor_vllm(redis_url):
    code = (
        "import sys; from api.app import create_app; from llmpipe.settings import Settings; "
        f"create_app(Settings(redis_url={redis_url!r})); "
        "bad = [m for m in ('torch', 'vllm', 'transformers') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _calls(r, cmd: str) -> int:
    return r.info("commandstats").get(f"cmdstat_{cmd}", {}).get("calls", 0)


@pytest.mark.parametrize("text_len", [2, 70_000], ids=["result-in-the-wake", "result-too-long-for-the-wake"])
def test_long_poll_wakes_when_the_job_record_ends_at_no_redis_cost(client, redis_client, helpers, text_len):
    """Waiting subscribes nothing per job (the waiter's one pattern subscription hears every
    job's end), and the wake carries the ended job, so the long-poll reads the record once,
    before it waits; a result too long for the wake is read from the record."""
    import threading
    import time

    waiter = client.app.state.waiter
    client.get("/v1/jobs/warm-up", params={"wait": 0.01})  # the waiter connects (404)
    job_id = client.post("/v1/jobs", json={"prompt": "x"}).json()["id"]
    out = {}

    def poll():
        out["view"] = client.get(f"/v1/jobs/{job_id}", params={"wait": 10}).json()
        out["at"] = time.time()

    subs, reads = _calls(redis_client, "subscribe") + _calls(redis_client, "unsubscribe"), _calls(redis_client, "hgetall")
    t = threading.Thread(target=poll)
    t.start()
    # End the job only once the long-poll waits, so the test checks the wake-up.
    assert helpers.wait_for(lambda: helpers.waiting(waiter, redis_client, job_id) == 1)
    assert redis_client.pubsub_channels("llmpipe:job-done:*") == []
    done_at = time.time()
    text = "hi" * (text_len // 2)
    helpers.finish_job(redis_client, job_id, text=text)
    t.join(10)
    assert out["view"]["status"] == "succeeded" and out["view"]["result"]["results"][0]["text"] == text
    assert out["view"] == client.get(f"/v1/jobs/{job_id}").json()  # what the record says
    assert out["at"] - done_at < 1.0
    assert helpers.wait_for(lambda: waiter.watchers(job_id) == 0)
    assert _calls(redis_client, "subscribe") + _calls(redis_client, "unsubscribe") == subs
    # (finish_job's move reads no hash whole; the GET just above is one more read)
    assert _calls(redis_client, "hgetall") - reads == (2 if text_len < 65536 else 3)


def test_an_ended_job_never_changes(client, redis_client, helpers):
    """The record is the one source of truth: a cancel after the result changes nothing,
    and a result after a cancel is dropped."""
    done = client.post("/v1/jobs", json={"prompt": "x"}).json()["id"]
    helpers.finish_job(redis_client, done)
    assert client.post(f"/v1/jobs/{done}/cancel").json()["status"] == "succeeded"
    assert client.get(f"/v1/jobs/{done}").json()["result"]["results"][0]["text"] == "hi"
    assert not redis_client.exists(f"llmpipe:cancelled:{done}")  # nothing told the workers to stop

    gone = client.post("/v1/jobs", json={"prompt": "x"}).json()["id"]
    assert client.post(f"/v1/jobs/{gone}/cancel").json()["status"] == "cancelled"
    from llmpipe.jobs.store import JobStore
    from llmpipe.messages import JobResult

    late = JobResult.model_validate({"job_id": gone, "status": "succeeded", "results": [], "usage": {}})
    assert not JobStore(redis_client, 60).finish(late)
    view = client.get(f"/v1/jobs/{gone}").json()
    assert view["status"] == "cancelled" and view["result"] is None


def test_job_deadline_index_holds_only_unfinished_jobs(client, redis_client, helpers):
    from llmpipe.jobs.store import DEADLINE_INDEX, JobStore

    a = client.post("/v1/jobs", json={"prompt": "x"}).json()["id"]
    b = client.post("/v1/jobs", json={"prompt": "x"}).json()["id"]
    helpers.finish_job(redis_client, a)
    client.post(f"/v1/jobs/{b}/cancel")
    assert redis_client.zcard(DEADLINE_INDEX) == 0
    # an entry whose record is long gone (no watchdog ran) is trimmed by the next create
    redis_client.zadd(DEADLINE_INDEX, {"ancient": 1000.0})
    JobStore(redis_client, 60).create("new", n_prompts=1, deadline=2e9)
    assert redis_client.zrange(DEADLINE_INDEX, 0, -1) == [b"new"]


def test_full_queue_gives_429_with_retry_after_and_the_stage(redis_client, redis_url, tmp_path):
    from api.app import create_app

    s = Settings(redis_url=redis_url, state_dir=tmp_path, max_queue_depth=3)
    with TestClient(create_app(s)) as c:
        assert [c.post("/v1/jobs", json={"prompt": "x"}).status_code for _ in range(3)] == [202] * 3
        r = c.post("/v1/jobs", json={"prompt": "x"})
        assert r.status_code == 429
        assert int(r.headers["Retry-After"]) >= 1
        err = r.json()["error"]
        assert err["type"] == "overloaded" and err["stage"] == "preprocess" and "preprocess queue is full" in err["message"]
        assert len(redis_client.lrange("preprocess", 0, -1)) == 3  # nothing enqueued for the rejected job


def test_body_over_the_limit_is_413(redis_client, redis_url, tmp_path):
    from api.app import create_app

    s = Settings(redis_url=redis_url, state_dir=tmp_path, max_body_bytes=1000)
    with TestClient(create_app(s)) as c:
        r = c.post("/v1/jobs", json={"prompt": "x" * 2000})
        assert r.status_code == 413 and r.json()["error"]["type"] == "limit_exceeded"


def test_cancel_unknown_is_404_and_cancel_marks_the_job(client, redis_client):
    assert client.post("/v1/jobs/nope/cancel").status_code == 404
    job_id = client.post("/v1/jobs", json={"prompt": "x"}).json()["id"]
    r = client.post(f"/v1/jobs/{job_id}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    assert redis_client.exists(f"llmpipe:cancelled:{job_id}")
    assert client.get(f"/v1/jobs/{job_id}").json()["status"] == "cancelled"


def test_openapi_documents_every_endpoint_and_error(client):
    spec = client.get("/openapi.json").json()
    paths = spec["paths"]
    for path, method in [("/v1/jobs", "post"), ("/v1/jobs/{job_id}", "get"), ("/v1/jobs/{job_id}", "delete"),
                         ("/v1/completions", "post"), ("/v1/chat/completions", "post"), ("/v1/models", "get"),
                         ("/metrics", "get"), ("/healthz", "get")]:
        assert method in paths[path], (path, method)
    assert {"400", "429", "422", "503", "401", "403", "413"} <= set(paths["/v1/jobs"]["post"]["responses"])
    assert "404" in paths["/v1/jobs/{job_id}"]["get"]["responses"]


def test_deadletters_are_listed_and_removed(client, redis_client):
    from llmpipe.jobs.deadletter import DeadLetters

    e = DeadLetters(redis_client).record(stage="inference", reason="engine_error", message="boom", job_id="j", request_id="j-0")
    body = client.get("/v1/admin/deadletters").json()
    assert body["count"] == 1 and body["data"][0]["request_id"] == "j-0"
    assert client.delete(f"/v1/admin/deadletters/{e['id']}").status_code == 204
    assert client.delete(f"/v1/admin/deadletters/{e['id']}").status_code == 404
    assert client.get("/v1/admin/deadletters").json()["count"] == 0


def test_job_records_are_indexed_for_the_watchdog(client, redis_client):
    job_id = client.post("/v1/jobs", json={"prompt": "x", "timeout": 5}).json()["id"]
    assert redis_client.zscore("llmpipe:job-deadlines", job_id) is not None


def _reserved(r) -> tuple[int, int, int, int]:
    return (int(r.get("llmpipe:admission:tokens") or 0), r.zcard("llmpipe:admission:pending"),
            r.zcard("llmpipe:admission:jobs"), r.hlen("llmpipe:admission:job_tokens"))


def test_a_job_that_cannot_be_enqueued_keeps_no_admission_reservation(client, redis_client, monkeypatch):
    from types import SimpleNamespace

    import redis

    import api.jobs.service

    def down(*a, **k):
        raise redis.exceptions.ConnectionError("blip")

    # the broker publish fails: the job ends failed, its reservation is freed
    monkeypatch.setattr(api.jobs.service, "chord", lambda header, body: SimpleNamespace(apply_async=down))
    r = client.post("/v1/jobs", json={"prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable"
    assert _reserved(redis_client) == (0, 0, 0, 0)
    [key] = redis_client.keys("llmpipe:job:*")
    assert redis_client.hget(key, "status") == b"failed"
    assert int(redis_client.get("llmpipe:admission:drained") or 0) == 0  # not counted as drained

    # the job record cannot be written: nothing stays reserved either
    monkeypatch.setattr(client.app.state.jobs.store, "create", down)
    assert client.post("/v1/jobs", json={"prompt": "x"}).status_code == 503
    assert _reserved(redis_client) == (0, 0, 0, 0)


def test_the_queued_message_shows_ids_and_sizes_not_the_prompt(client, redis_client):
    """Task events (Flower) and worker logs show a message's ``argsrepr``: by default it holds
    no prompt text (llmpipe/observability/summaries.py)."""
    r = client.post("/v1/jobs", json={"prompt": "the secret plan " * 40, "max_tokens": 5})
    job_id = r.json()["id"]
    [msg] = _queued_messages(redis_client)
    shown = msg["headers"]["argsrepr"]
    assert shown == f"(job_id={job_id} index=0 prompt_chars={len('the secret plan ' * 40)})"
    assert "secret" not in shown
    assert "secret" in json.loads(base64.b64decode(msg["body"]))[0][0]["prompt"]  # the message itself is whole


def test_log_content_keeps_celerys_own_argsrepr(redis_client, redis_url, tmp_path):
    from api.app import create_app

    s = Settings(redis_url=redis_url, state_dir=tmp_path, log_content=True)
    with TestClient(create_app(s)) as c:
        assert c.post("/v1/jobs", json={"prompt": "the secret plan", "max_tokens": 5}).status_code == 202
    [msg] = _queued_messages(redis_client)
    assert "the secret plan" in msg["headers"]["argsrepr"]


def test_log_content_holds_where_the_tasks_are_registered_too(redis_client, redis_url, tmp_path):
    """Where the stage tasks are registered in the API's process too (a test process), a
    message goes out through the task class, which fills in a summary by the process's
    settings when the message names no ``argsrepr`` (llmpipe/broker/requeue.py): the API's own
    log_content must still decide."""
    import tasks.preprocess  # noqa: F401  registers llmpipe.preprocess in this process's app
    from api.app import create_app

    s = Settings(redis_url=redis_url, state_dir=tmp_path, log_content=True)
    with TestClient(create_app(s)) as c:
        assert c.post("/v1/jobs", json={"prompt": "the secret plan", "max_tokens": 5}).status_code == 202
    [msg] = _queued_messages(redis_client)
    assert "the secret plan" in msg["headers"]["argsrepr"]
