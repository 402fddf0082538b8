"""The serial baseline server answers the job API and the OpenAI completions endpoint
(streamed and not), and the load generator reads them the same way."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def serial(tmp_path_factory, tiny_model):
    from llmpipe.bench.modes import MODES, EngineSetup, start_server
    from llmpipe.settings import EngineKind

    setup = EngineSetup(key="simulated", kind=EngineKind.SIMULATED, label="SIMULATED", model_path=tiny_model,
                        max_model_len=256, sim={"sim_step_ms": 1.0, "sim_preprocess_cpu_ms": 2.0})
    server = start_server(MODES["serial"], setup, "redis://127.0.0.1:1/0", tmp_path_factory.mktemp("serial"),
                          ready_timeout=120)
    yield server
    server.stop()


def test_jobs_and_openai_protocols(serial):
    from llmpipe.bench.loadgen import JobsClient, enrich, run_load
    from llmpipe.bench.openai_client import OpenAIClient
    from llmpipe.bench.stats import summarize

    prompts = [f"prompt number {i} about bicycles" for i in range(6)]
    jobs = asyncio.run(run_load(JobsClient(serial.url, 5), prompts, requests=6, concurrency=3))
    assert all(s.ok for s in jobs), [s.error for s in jobs]
    assert all(s.completion_tokens == 5 and s.batch_size == 1 and s.engine_interval for s in jobs)

    oa = asyncio.run(run_load(OpenAIClient(serial.url, 5, "any"), prompts, requests=6, concurrency=3))
    assert all(s.ok and s.ttft_s is not None and s.completion_tokens == 5 for s in oa), [s.error for s in oa]
    assert asyncio.run(enrich(serial.url, oa)) == 6
    s = summarize(oa, warmup=3)
    assert s["engine_busy"]["method"].startswith("server") and 0 < s["engine_busy"]["fraction"] <= 1
    # Not streamed: one JSON answer, no TTFT, and its id still names the job.
    plain = asyncio.run(run_load(OpenAIClient.of_kind("completions", serial.url, 5, "any"), prompts, requests=3,
                                 concurrency=3))
    assert all(s.ok and s.ttft_s is None and s.completion_tokens == 5 for s in plain), [s.error for s in plain]
    assert asyncio.run(enrich(serial.url, plain)) == 3
    # One at a time: engine intervals never overlap.
    spans = sorted(x.engine_interval for x in jobs)
    assert all(a[1] <= b[0] + 1e-3 for a, b in zip(spans, spans[1:]))
