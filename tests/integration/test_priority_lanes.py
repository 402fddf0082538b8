"""Priority lanes on the real stack (Redis broker, real worker processes, the SIMULATED
engine on the tiny model's tokenizer): an interactive job overtakes a batch backlog that
was queued before it, and the backlog still finishes."""

from __future__ import annotations

import statistics
import time

import httpx
import pytest
import redis

from llmpipe.local.redis_server import free_port
from tests.harness.stacks import teardown

pytestmark = pytest.mark.integration

BACKLOG = 48


@pytest.fixture(scope="module")
def lanes_pipeline(tmp_path_factory, redis_server, tiny_model):
    from llmpipe.local.pipeline import LocalPipeline
    from llmpipe.settings import Settings

    redis.Redis.from_url(redis_server.url).flushdb()
    # Small batches of a slow "GPU" (40 ms per decode step, 8 steps a request): the backlog is
    # twelve batches deep, seconds long, while posting it takes a fraction of a second.
    s = Settings(redis_url=redis_server.url, model=tiny_model, engine="simulated",
                 state_dir=tmp_path_factory.mktemp("lanes"), api_port=free_port(), cpu_workers=1, max_batch_size=4,
                 batch_window_ms=0, sim_step_ms=40.0, sim_step_ms_per_seq=0.0, sim_prefill_ms_per_token=0.0)
    p = LocalPipeline(s, flower=False).start()
    try:
        p.wait_ready(timeout=240)
    except Exception:
        teardown(p, timeout=10)
        raise
    yield p
    teardown(p)


def _end(view: dict) -> float:
    """When the job's last stage finished (epoch s): created_at plus each stage's wait and run."""
    t = view["result"]["results"][0]["timings"]
    return view["created_at"] + sum(t[s]["queue_wait_s"] + t[s]["run_s"] for s in ("preprocess", "inference", "postprocess"))


def _wait_all(http: httpx.Client, ids: list[str], timeout: float = 120.0) -> dict[str, dict]:
    done: dict[str, dict] = {}
    end = time.monotonic() + timeout
    while len(done) < len(ids):
        assert time.monotonic() < end, f"{len(ids) - len(done)} jobs not finished in {timeout}s"
        for j in ids:
            if j not in done:
                v = http.get(f"/v1/jobs/{j}", params={"wait": 5}).json()
                if v["status"] in ("succeeded", "failed", "expired", "cancelled"):
                    done[j] = v
    return done


def test_an_interactive_job_overtakes_a_batch_backlog(lanes_pipeline):
    body = {"prompt": "the quick brown fox jumps", "max_tokens": 8, "ignore_eos": True}
    with httpx.Client(base_url=lanes_pipeline.api_url, timeout=30) as http:
        batch = [http.post("/v1/jobs", json={**body, "priority": 10}).json()["id"] for _ in range(BACKLOG)]
        # the backlog is running: the first batch job is through
        first = _wait_all(http, batch[:1])
        assert first[batch[0]]["status"] == "succeeded"
        inter = http.post("/v1/jobs", json={**body, "priority": 0}).json()["id"]
        views = _wait_all(http, [*batch, inter])
    assert all(v["status"] == "succeeded" for v in views.values())  # the batch lane is not starved
    i_end = _end(views[inter])
    overtaken = sum(_end(views[j]) > i_end for j in batch)
    # queued after all 40, it finished ahead of most of them
    assert overtaken >= BACKLOG // 2, f"only {overtaken} of {BACKLOG} earlier batch jobs finished after it"
    # and it waited less than the backlog's median job (in FIFO order it would wait for
    # everything queued before it: longer than that median)
    i_lat = i_end - views[inter]["created_at"]
    b_p50 = statistics.median(_end(views[j]) - views[j]["created_at"] for j in batch)
    assert i_lat < b_p50, f"interactive {i_lat:.2f}s vs batch p50 {b_p50:.2f}s"


def test_priority_out_of_range_is_422_naming_the_field(lanes_pipeline):
    with httpx.Client(base_url=lanes_pipeline.api_url, timeout=30) as http:
        r = http.post("/v1/jobs", json={"prompt": "x", "priority": 1001})
    assert r.status_code == 422 and r.json()["error"]["param"] == "priority"
