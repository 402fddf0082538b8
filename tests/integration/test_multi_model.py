"""Two models behind one API, end to end: real Redis, real workers (one inference worker per
model, on its own queue inference.<name>), real vLLM on two tiny models of other weights.

One pipeline, in phases, so that each model is also seen running alone:
1. both serve: each answer comes from the model the request named (the two differ);
2. ``kill -9`` of b's inference worker: a's jobs still succeed, token for token as before
   (a now runs alone); b's jobs wait in inference.b (one with a short deadline expires
   there), and /healthz names ``inference.b``;
3. a's worker is killed and b's started again: b's waiting job completes, token for token
   as b answered in phase 1 (b now runs alone).
"""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from tests.harness.stacks import teardown
from tests.harness.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
SHORT_TIMEOUT_S = 15  # the job that expires in inference.b: settled by the watchdog 5 s later


def _submit(url: str, model: str, prompt: str, **kw) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **kw}
    r = httpx.post(f"{url}/v1/jobs", json=body, timeout=10)
    assert r.status_code == 202, r.text
    return r.json()["id"]


def _view(url: str, job_id: str) -> dict:
    return httpx.get(f"{url}/v1/jobs/{job_id}", timeout=10).json()


def _done(url: str, job_id: str, timeout: float = 60.0) -> dict:
    return wait_until(lambda: (v := _view(url, job_id))["status"] not in ("queued", "running") and v, timeout,
                  f"job {job_id}")


def _tokens(url: str, job_id: str) -> list[int]:
    view = _done(url, job_id)
    assert view["status"] == "succeeded", view
    return view["result"]["results"][0]["token_ids"]


def _kill(child) -> None:
    os.killpg(child.proc.pid, signal.SIGKILL)  # the worker and everything in its group
    child.proc.wait(10)


@pytest.fixture(scope="module")
def two_models(tmp_path_factory, redis_server, tiny_model, tiny_model_b, pipeline_starter):
    import redis

    redis.Redis.from_url(redis_server.url).flushdb()
    p = pipeline_starter(tmp_path_factory.mktemp("pipe-two-models"), redis_server.url, tiny_model, "vllm",
                         models=[f"a={tiny_model}", f"b={tiny_model_b}"], flower=False)
    yield p
    teardown(p)


def test_two_models_route_right_and_one_dead_worker_leaves_the_other_alone(two_models, redis_server):
    import redis

    p, url = two_models, two_models.api_url
    r = redis.Redis.from_url(redis_server.url)
    assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["a", "b"]
    assert {c.name for c in p.sup.children} >= {"inference.a", "inference.b"}

    # 1. Both serve; the OpenAI route answers with the model it ran.
    both = {m: [_tokens(url, _submit(url, m, prompt)) for prompt in PROMPTS] for m in ("a", "b")}
    assert both["a"] != both["b"]  # other weights: a request that reached the wrong model would show
    chat = httpx.post(f"{url}/v1/completions", json={"model": "b", "prompt": PROMPTS[0], "max_tokens": 12,
                                                      "temperature": 0, "ignore_eos": True}, timeout=60).json()
    assert chat["model"] == "b"

    # 2. b's inference worker dies: a's jobs do not notice, b's wait in b's queue.
    _kill(p.sup.get("inference.b"))
    # Long enough to outlive b's restart below: a vLLM start on a busy machine takes minutes.
    waiting = _submit(url, "b", PROMPTS[0], timeout=600)
    # Short, but long enough to reach inference.b: preprocess sends a request whose deadline
    # has passed nowhere, and under load (the other test process, a's jobs) it waited over 2 s.
    short = _submit(url, "b", PROMPTS[1], timeout=SHORT_TIMEOUT_S)
    alone_a = [_tokens(url, _submit(url, "a", prompt)) for prompt in PROMPTS]
    assert alone_a == both["a"]
    wait_until(lambda: r.llen("inference.b") == 2, 30, "b's two jobs in inference.b")
    assert _view(url, waiting)["status"] in ("queued", "running")
    health = wait_until(lambda: (h := httpx.get(f"{url}/healthz")).status_code == 503 and h, 30,
                    "/healthz to see b's worker gone")
    assert health.json()["error"]["stages"] == ["inference.b"]
    # The watchdog settles a job that waited past its deadline (plus its grace).
    assert _done(url, short, timeout=30)["status"] == "expired"

    # 3. b comes back while a is gone: the job that waited completes, as b answered before.
    _kill(p.sup.get("inference.a"))
    p.sup.respawn(p.sup.get("inference.b"))
    wait_until(lambda: httpx.get(f"{url}/healthz").json().get("error", {}).get("stages") == ["inference.a"], 300,
               "/healthz to see b's worker back and a's gone")
    assert _tokens(url, waiting) == both["b"][0]
    assert _view(url, short)["status"] == "expired"  # its deadline passed: never run late
