"""Several models behind one API, at the API with a real Redis and no workers: what
/v1/models lists, the 404 for a model not served, the queue a job's inference task is sent
to, per-model admission and what /healthz names when one model's workers are gone."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from llmpipe.settings import Settings


@pytest.fixture
def client(redis_client, redis_url, tmp_path, tiny_model):
    from api.app import create_app

    s = Settings(redis_url=redis_url, state_dir=tmp_path, models=[f"a={tiny_model}", f"b={tiny_model}"],
                 max_queue_depth=3)
    with TestClient(create_app(s)) as c:
        yield c


def _inference_queue_of(redis_client) -> str:
    """The queue the chain in the newest preprocess message sends its inference task to."""
    raw = redis_client.lindex("preprocess", 0)
    body = json.loads(raw)["body"]
    import base64

    _, _, embed = json.loads(base64.b64decode(body))
    inference = embed["chain"][-1]  # Celery pops the chain from its end
    assert inference["task"] == "llmpipe.inference"
    return inference["options"]["queue"]


def test_models_lists_every_served_model_first_the_default(client):
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["a", "b"]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/jobs", {"model": "gpt-4", "prompt": "hi"}),
    ("/tokenize", {"model": "gpt-4", "prompt": "hi"}),
    ("/detokenize", {"model": "gpt-4", "tokens": [1]}),
])
def test_a_model_not_served_is_404_model_not_found(client, redis_client, path, body):
    r = client.post(path, json=body)
    err = r.json()["error"]
    assert r.status_code == 404 and err["type"] == "model_not_found" and err["param"] == "model"
    assert err["code"] == 404 and "gpt-4" in err["message"] and r.headers["x-should-retry"] == "false"
    assert redis_client.llen("preprocess") == 0  # nothing was enqueued


def test_openapi_documents_the_404_on_the_submitting_routes(client):
    spec = client.get("/openapi.json").json()
    for path in ("/v1/jobs", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        assert "not served" in spec["paths"][path]["post"]["responses"]["404"]["description"], path


@pytest.mark.parametrize("model, queue", [(None, "inference.a"), ("a", "inference.a"), ("b", "inference.b")])
def test_a_job_is_routed_to_its_models_inference_queue(client, redis_client, model, queue):
    r = client.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 2, **({"model": model} if model else {})})
    assert r.status_code == 202
    assert _inference_queue_of(redis_client) == queue
    msg = json.loads(redis_client.lindex("preprocess", 0))
    import base64

    (prompt,), kwargs, _ = json.loads(base64.b64decode(msg["body"]))
    assert prompt["model"] == (model or "a")  # the CPU stages pick this model's tokenizer


def test_a_backed_up_model_queue_refuses_only_that_models_jobs(client, redis_client):
    redis_client.rpush("inference.b", *["x"] * 3)  # b's inference queue at its limit (max_queue_depth=3)
    r = client.post("/v1/jobs", json={"prompt": "hi", "model": "b"})
    assert r.status_code == 429 and r.json()["error"]["stage"] == "inference.b"
    assert client.post("/v1/jobs", json={"prompt": "hi", "model": "a"}).status_code == 202


def test_healthz_names_the_model_whose_inference_workers_are_gone(client, redis_client):
    from llmpipe.observability.readiness import ReadinessBeacon

    b = ReadinessBeacon(redis_client, ["preprocess", "inference.a", "postprocess", "collect"], "n1").start()
    try:
        r = client.get("/healthz")
        assert r.status_code == 503 and r.json()["error"]["stages"] == ["inference.b"]
        assert "inference.b" in client.get("/health").json()["error"]["message"]
        depth = client.get("/metrics").text
        assert 'llmpipe_queue_depth_messages{model="b",queue="inference.b"}' in depth
        assert 'llmpipe_stage_live_workers{stage="inference.a"} 1.0' in depth
    finally:
        b.stop()
