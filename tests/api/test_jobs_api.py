"""The job API against a real Redis, with no workers: what it enqueues and reports."""

from __future__ import annotations

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
    from llmpipe.redis_server import free_port

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


def test_long_poll_wakes_when_the_result_is_stored_and_leaves_no_subscription(client, redis_client):
    import threading
    import time

    from llmpipe.celery_app import app as celery

    job_id = client.post("/v1/jobs", json={"prompt": "x"}).json()["id"]
    out = {}

    def poll():
        t0 = time.monotonic()
        out["view"] = client.get(f"/v1/jobs/{job_id}", params={"wait": 10}).json()
        out["dt"] = time.monotonic() - t0

    t = threading.Thread(target=poll)
    t.start()
    # Store the result only once the long-poll is subscribed, so the test checks the wake-up.
    channel = f"celery-task-meta-{job_id}"
    end = time.monotonic() + 5
    while time.monotonic() < end and not dict(redis_client.pubsub_numsub(channel)).get(channel.encode()):
        time.sleep(0.01)
    assert dict(redis_client.pubsub_numsub(channel)).get(channel.encode()) == 1
    result = {"job_id": job_id, "status": "succeeded", "results": [], "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}, "error": None}
    celery.backend.store_result(job_id, result, "SUCCESS")
    t.join(10)
    assert out["view"]["status"] == "succeeded"
    assert out["dt"] < 5
    assert [c for c in redis_client.pubsub_channels() if b"job" in c or b"celery" in c] == []


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


def test_delete_unknown_is_404_and_cancel_marks_the_job(client, redis_client):
    assert client.delete("/v1/jobs/nope").status_code == 404
    job_id = client.post("/v1/jobs", json={"prompt": "x"}).json()["id"]
    r = client.delete(f"/v1/jobs/{job_id}")
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
    from llmpipe.deadletter import DeadLetters

    e = DeadLetters(redis_client).record(stage="inference", reason="engine_error", message="boom", job_id="j", request_id="j-0")
    body = client.get("/v1/admin/deadletters").json()
    assert body["count"] == 1 and body["data"][0]["request_id"] == "j-0"
    assert client.delete(f"/v1/admin/deadletters/{e['id']}").status_code == 204
    assert client.delete(f"/v1/admin/deadletters/{e['id']}").status_code == 404
    assert client.get("/v1/admin/deadletters").json()["count"] == 0


def test_job_records_are_indexed_for_the_watchdog(client, redis_client):
    job_id = client.post("/v1/jobs", json={"prompt": "x", "timeout": 5}).json()["id"]
    assert redis_client.zscore("llmpipe:job-deadlines", job_id) is not None
