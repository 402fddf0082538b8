"""End to end through real Redis, real worker processes and a real engine (vLLM and
transformers) on the tiny model."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from llmpipe.bench.loadgen import engine_interval
from llmpipe.settings import EngineKind
from tests.harness.shared import lends
from workers.launch import engine_running

pytestmark = pytest.mark.integration


def wait_job(url: str, job_id: str, timeout: float = 120.0) -> dict:
    end = time.monotonic() + timeout
    with httpx.Client(base_url=url, timeout=10) as c:
        while time.monotonic() < end:
            view = c.get(f"/v1/jobs/{job_id}").json()
            if view["status"] not in ("queued", "running"):
                return view
            time.sleep(0.05)
    raise AssertionError(f"job {job_id} not done after {timeout}s")


def run_job(url: str, body: dict, timeout: float = 120.0) -> dict:
    r = httpx.post(f"{url}/v1/jobs", json=body, timeout=10)
    assert r.status_code == 202, r.text
    created = r.json()
    assert created["status_url"] == f"/v1/jobs/{created['id']}"
    return wait_job(url, created["id"], timeout)


@pytest.fixture(scope="module")
@lends(lambda params: ("direct engine", params["pipeline"][0]))
def direct_engine(pipeline, tiny_model, shared_stacks):
    """The same engine kind, called directly in this process (one per engine kind: the
    pipelines of one engine on either broker have the same engine settings)."""
    from llmpipe.engines.factory import create_engine

    return shared_stacks.get(("direct engine", pipeline.s.engine.value),
                             lambda: create_engine(pipeline.s.model_copy(update={"max_batch_size": 8}), tiny_model),
                             lambda engine: engine.shutdown())


PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "A quick brown fox jumps over the lazy dog and then",
    "Hello",
    "Numbers: one two three four five six seven eight nine ten",
]


def _direct(engine, tokenizer, prompts, max_tokens):
    from llmpipe.engines.base import EngineRequest
    from llmpipe.messages import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    reqs = [EngineRequest(f"d{i}", tokenizer(p, add_special_tokens=True)["input_ids"], params) for i, p in enumerate(prompts)]
    return [o.token_ids for o in engine.generate(reqs)]


def test_the_engine_reports_the_running_set_its_worker_is_sized_for(pipeline, direct_engine):
    """vLLM's max_num_seqs as vLLM resolved it: left unset, its own default on a CPU, which the
    inference worker's threads are sized for (workers/launch.py) and the batch lane's share is
    taken of (workers/inference_runtime.py). The transformers engine runs whole batches: none."""
    if pipeline.s.engine == EngineKind.VLLM:
        assert pipeline.s.max_num_seqs is None
        assert direct_engine.max_num_seqs == engine_running(pipeline.s) == 128
    else:
        assert getattr(direct_engine, "max_num_seqs", None) is None


def test_greedy_job_matches_engine_called_directly(pipeline, direct_engine, tiny_tokenizer):
    view = run_job(pipeline.api_url, {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0})
    assert view["status"] == "succeeded", view
    res = view["result"]["results"][0]
    expected = _direct(direct_engine, tiny_tokenizer, [PROMPTS[0]], 12)[0]
    assert res["token_ids"] == expected
    assert res["text"] == tiny_tokenizer.decode(expected, skip_special_tokens=True)
    assert res["prompt_tokens"] == len(tiny_tokenizer(PROMPTS[0])["input_ids"])
    assert res["completion_tokens"] == len(expected)
    assert res["finish_reason"] in ("stop", "length")
    assert set(res["timings"]) == {"preprocess", "inference", "postprocess"}
    for t in res["timings"].values():
        assert t["queue_wait_s"] >= 0 and t["run_s"] >= 0
    usage = view["result"]["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_five_prompt_job_comes_back_in_order(pipeline, direct_engine, tiny_tokenizer):
    view = run_job(pipeline.api_url, {"prompts": PROMPTS, "max_tokens": 8, "temperature": 0})
    assert view["status"] == "succeeded", view
    results = view["result"]["results"]
    assert [r["index"] for r in results] == list(range(5))
    expected = _direct(direct_engine, tiny_tokenizer, PROMPTS, 8)
    assert [r["token_ids"] for r in results] == expected


def test_chat_messages_use_the_chat_template(pipeline, direct_engine, tiny_tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    view = run_job(pipeline.api_url, {"messages": messages, "max_tokens": 6, "temperature": 0})
    assert view["status"] == "succeeded", view
    ids = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert view["result"]["results"][0]["prompt_tokens"] == len(ids)


def test_forty_concurrent_requests_are_batched(pipeline):
    # Long enough that each engine run outlasts the gap between two arrivals from the one
    # preprocess process: with 8 tokens, on RabbitMQ on a slow day, every request found the
    # engine idle and ran alone (a scenario without concurrency, not a batching failure).
    body = {"prompt": "Tell me a story about", "max_tokens": 48, "temperature": 0, "ignore_eos": True}

    def one(_):
        return run_job(pipeline.api_url, body, timeout=180)

    with ThreadPoolExecutor(40) as ex:
        views = list(ex.map(one, range(40)))
    assert all(v["status"] == "succeeded" for v in views), [v["status"] for v in views]
    sizes = [v["result"]["results"][0]["batch_size"] for v in views]
    together = most_in_the_engine_at_once(views)
    print(f"\n[{pipeline.s.engine.value}] batch sizes under 40 concurrent requests: {sorted(sizes)}; "
          f"at most {together} in the engine at once")
    assert together > 1
    if pipeline.s.engine == EngineKind.TRANSFORMERS:
        # One batch at a time: the batcher's batches are the engine's.
        assert max(sizes) > 1
    assert all(len(v["result"]["results"][0]["token_ids"]) == 48 for v in views)


def most_in_the_engine_at_once(views: list[dict]) -> int:
    """How many jobs the engine held at once: the most engine intervals that contain one of
    them's midpoint. vLLM batches continuously: a request the batcher hands it alone (its
    queue was empty when it came) joins the running batch, so the engine's own concurrency,
    not the batcher's batch size, is what shows batching there. Midpoints, so that jobs run
    one after another never count as together, whatever the clocks' jitter."""
    spans = [engine_interval(v["created_at"], v["result"]["results"][0]["timings"],
                             v["result"]["results"][0]["engine_time_s"]) for v in views]
    return max(sum(a <= (s + e) / 2 <= b for a, b in spans) for s, e in spans)


def test_inference_tasks_show_as_succeeded_in_flower(pipeline):
    # Its own five jobs, so that the test passes or fails on its own, in any order.
    body = {"prompt": "flower", "max_tokens": 2, "temperature": 0}
    ids = [httpx.post(f"{pipeline.api_url}/v1/jobs", json=body, timeout=10).json()["id"] for _ in range(5)]
    for job_id in ids:
        assert wait_job(pipeline.api_url, job_id)["status"] == "succeeded"
    url = f"http://127.0.0.1:{pipeline.s.flower_port}"
    end = time.monotonic() + 30
    tasks, workers, shown = {}, {}, set()
    while time.monotonic() < end:
        try:
            tasks = httpx.get(f"{url}/api/tasks", params={"taskname": "llmpipe.inference", "state": "SUCCESS"}, timeout=5).json()
            workers = httpx.get(f"{url}/api/workers", params={"refresh": "true"}, timeout=10).json()
        except httpx.HTTPError:
            pass
        shown = {j for j in ids if any(j in str(t.get("args")) for t in tasks.values())}
        if shown == set(ids) and len(workers) >= 3:
            break
        time.sleep(0.5)
    assert shown == set(ids)  # this test's own inference tasks, whatever ran before
    assert all(t["state"] == "SUCCESS" and t["name"] == "llmpipe.inference" for t in tasks.values())
    kinds = {name.split("@")[0].rsplit("-", 1)[0] for name in workers}
    assert {"preprocess", "inference", "postprocess"} <= kinds


def test_prompt_over_the_context_fails_with_the_limit_named(pipeline):
    view = run_job(pipeline.api_url, {"prompt": "word " * 3000, "max_tokens": 16})
    assert view["status"] == "failed"
    assert view["error"]["type"] == "context_length_exceeded"
    assert "context length of 2048" in view["error"]["message"]
    assert view["result"]["results"][0]["finish_reason"] == "error"


def test_unknown_job_is_404_and_bad_body_is_422(pipeline):
    r = httpx.get(f"{pipeline.api_url}/v1/jobs/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found"
    r = httpx.post(f"{pipeline.api_url}/v1/jobs", json={"prompt": "hi", "max_tokens": 0})
    assert r.status_code == 422
    assert r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(f"{pipeline.api_url}/v1/jobs", json={"prompt": "hi", "prompts": ["a"]})
    assert r.status_code == 422 and "exactly one of" in r.json()["error"]["message"]


def test_long_poll_returns_when_the_job_finishes(pipeline):
    r = httpx.post(f"{pipeline.api_url}/v1/jobs", json={"prompt": "Hello there", "max_tokens": 4, "temperature": 0})
    job_id = r.json()["id"]
    t0 = time.monotonic()
    view = httpx.get(f"{pipeline.api_url}/v1/jobs/{job_id}", params={"wait": 30}, timeout=40).json()
    assert view["status"] == "succeeded"
    assert time.monotonic() - t0 < 20


def test_workers_start_without_waiting_on_mingle(pipeline):
    """Each worker took messages without Celery's one-second mingle at start (workers/launch.py)."""
    logs = {kind: (pipeline.sup.log_dir / f"{kind}.log").read_text() for kind in ("preprocess", "inference", "postprocess")}
    for kind, text in logs.items():
        assert " ready." in text, kind  # the worker started, and logged its start
        assert "mingle:" not in text, f"{kind} ran mingle at start"
