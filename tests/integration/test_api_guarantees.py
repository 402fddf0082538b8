"""The API's guarantees on the paths real clients take (docs/reliability.md, "API
guarantees"), end to end: real workers, the transformers engine on the tiny model behind
the test-only fault injector (markers in tests/integration/conftest.py), shipped defaults,
and the `openai` client on its defaults (it retries twice)."""

from __future__ import annotations

import json
import socket
import threading
import time
from functools import partial

import httpx
import pytest
import redis

from tests.harness.waiting import wait_until

pytestmark = pytest.mark.integration

# llmpipe/testing/faulty.py
STARTED = "llmpipe:test:engine-started"
DELAYS = "llmpipe:test:delays"


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith(name) and not ln.startswith("#") and not ln.startswith(name + "_created"))


_wait = partial(wait_until, every=0.02)


@pytest.fixture(scope="module")
def r(faulty_pipeline):
    return redis.Redis.from_url(faulty_pipeline.s.redis_url)


# -- 1. one request that fails for good makes one job ----------------------------------------
def test_openai_client_on_its_defaults_makes_one_job_per_failed_request(faulty_pipeline, r):
    import openai

    url = faulty_pipeline.api_url
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")  # default retries (2) and timeout
    model = faulty_pipeline.s.model

    admitted, dead = _metric(url, "llmpipe_requests_admitted_total"), r.zcard("llmpipe:deadletter")
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model=model, max_tokens=4, messages=[{"role": "user", "content": "POISONPILL"}])
    assert err.value.status_code == 424 and err.value.body["type"] == "engine_error"
    assert _metric(url, "llmpipe_requests_admitted_total") - admitted == 1
    assert r.zcard("llmpipe:deadletter") - dead == 1  # dead-lettered once, not three times

    admitted = _metric(url, "llmpipe_requests_admitted_total")
    # Hold the engine past the 50 ms deadline: on a quiet machine the tiny model answers
    # four tokens inside it, and the request would succeed instead of expiring.
    r.hset(DELAYS, "batch", 1.0)
    try:
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(model=model, max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                                           extra_body={"timeout": 0.05})
    finally:
        r.hdel(DELAYS, "batch")
    assert err.value.status_code == 504 and err.value.body["type"] == "expired"
    assert _metric(url, "llmpipe_requests_admitted_total") - admitted == 1


# -- 4. the streamed text is the final text, whatever was retried ---------------------------
def _ids_of(r, job_id: str) -> dict[int, list[int]]:
    from llmpipe.jobs.streaming import read_published

    return read_published(r, job_id)


def test_streamed_text_equals_the_final_text_with_a_poison_batch_mate_at_temperature_1(faulty_pipeline, r):
    """A streaming request shares an engine batch with one that makes the engine fail after
    8 tokens; the batch is split and the request runs again. At temperature 1 a fresh
    attempt would sample other tokens than those already streamed."""
    url = faulty_pipeline.api_url
    # Hold the engine with a blocker batch, so that the two requests meet in the next batch.
    r.hset(DELAYS, "batch", 3.0)
    try:
        blocker = httpx.post(f"{url}/v1/jobs", json={"prompt": "blocker", "max_tokens": 1}).json()["id"]
        _wait(lambda: r.hexists(STARTED, f"{blocker}-0"), 60, "the blocker batch to start")
        out: dict = {}

        def stream():
            body = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 1.0, "ignore_eos": True,
                    "stream": True}
            deltas, job = [], None
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
                for ln in resp.iter_lines():
                    if not ln.startswith("data: ") or ln == "data: [DONE]":
                        continue
                    obj = json.loads(ln[6:])
                    job = obj["id"].removeprefix("cmpl-")
                    deltas.append(obj["choices"][0]["text"])
            out["job"], out["text"] = job, "".join(deltas)

        t = threading.Thread(target=stream)
        t.start()
        poison = httpx.post(f"{url}/v1/jobs", json={"prompt": "LATEPOISON now", "max_tokens": 24, "temperature": 1.0,
                                                    "ignore_eos": True}).json()["id"]
        # both wait in the inference worker's batcher while the blocker runs
        _wait(lambda: _metric(url, "llmpipe_batcher_pending_requests") >= 2, 30, "both requests in the batcher",
              every=0.1)
    finally:
        r.hdel(DELAYS, "batch")
    t.join(120)
    view = httpx.get(f"{url}/v1/jobs/{out['job']}", params={"wait": 30}, timeout=40).json()
    assert view["status"] == "succeeded", view
    final = view["result"]["results"][0]
    assert int(r.hget(STARTED, f"{out['job']}-0")) == 2, "the request did not share the poisoned batch"
    assert httpx.get(f"{url}/v1/jobs/{poison}", params={"wait": 30}, timeout=40).json()["error"]["type"] == "engine_error"
    assert out["text"] == final["text"]
    assert _ids_of(r, out["job"])[0] == final["token_ids"] and len(final["token_ids"]) == 24


# -- 5. a client that goes away frees the engine within a second ---------------------------
LONG = {"max_tokens": 1500, "ignore_eos": True, "temperature": 0}


def _abort_seen_within(url: str, before: float, gone_at: float) -> float:
    _wait(lambda: _metric(url, "llmpipe_engine_aborts_total") > before, 10, "the engine to abort")
    return time.time() - gone_at


def test_a_streaming_client_that_disconnects_has_its_engine_request_aborted(faulty_pipeline, r):
    url = faulty_pipeline.api_url
    before = _metric(url, "llmpipe_engine_aborts_total")
    with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": "Tell me a story", "stream": True, **LONG},
                      timeout=60) as resp:
        lines = resp.iter_lines()
        text = ""
        while not text:  # the engine is generating for it
            ln = next(lines)
            if ln.startswith("data: "):
                text = json.loads(ln[6:])["choices"][0]["text"]
        gone_at = time.time()
    took = _abort_seen_within(url, before, gone_at)
    assert took < 1.0, took
    print(f"\nstreaming client gone -> engine abort seen after {took * 1000:.0f} ms (incl. /metrics polling)")


def test_a_non_streaming_client_that_disconnects_has_its_engine_request_aborted(faulty_pipeline, r):
    url = faulty_pipeline.api_url
    port = faulty_pipeline.s.api_port
    known = set(r.scan_iter("llmpipe:job:*"))
    body = json.dumps({"prompt": "Tell me a story", **LONG}).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    key = _wait(lambda: next(iter(set(r.scan_iter("llmpipe:job:*")) - known), None), 30, "the job")
    job_id = key.decode().removeprefix("llmpipe:job:")
    _wait(lambda: r.xlen(f"llmpipe:tokens:{job_id}") > 0, 60, "the engine to generate for it", every=0.05)
    before = _metric(url, "llmpipe_engine_aborts_total")
    s.close()
    gone_at = time.time()
    took = _abort_seen_within(url, before, gone_at)
    assert took < 1.0, took
    assert r.hget(key, "status") == b"cancelled"
    print(f"\nnon-streaming client gone -> engine abort seen after {took * 1000:.0f} ms (incl. /metrics polling)")
