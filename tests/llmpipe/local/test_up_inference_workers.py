"""`llmpipe up --inference-workers 2` as a user runs it (vLLM on the tiny model, its engine
core in a process of its own): two supervised inference children that share the CPU, both
counted by /healthz; a `kill -9` of one restarts that one alone, said on the console, while
the other serves; Ctrl-C stops everything warm, an engine core exiting by itself."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from tests.harness.clients import job_result, submit_job
from tests.harness.up import one_process, wait_text
from tests.harness.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _live_inference(up) -> int:
    try:
        return httpx.get(f"{up.url}/healthz", timeout=2).json().get("live_workers", {}).get("inference", 0)
    except (httpx.HTTPError, ValueError):
        return 0


@pytest.mark.timeout(900)  # two engine loads of up to 420 s each (the start, then the successor)
def test_up_runs_each_inference_worker_as_a_child_of_its_own(tmp_path, ups, tiny_model):
    up = ups(tmp_path / "state", "--model", tiny_model, "--engine", "vllm", "--redis-url", "embedded",
             "--cpu-workers", "1", "--no-flower", "--inference-workers", "2", VLLM_ENABLE_V1_MULTIPROCESSING="1",
             LLMPIPE_MAX_MODEL_LEN="512", LLMPIPE_MAX_BATCH_SIZE="4")
    up.wait_ready(timeout=420)
    assert "engine: vllm; 2 inference workers (sharing the CPU), prefix-aware routing" in up.err
    assert "x2 inference workers" in up.out
    assert _live_inference(up) == 2
    body = {"prompt": "once upon a time", "max_tokens": 8, "temperature": 0}

    first = one_process(up, "celery", "-n inference-1-")
    second = one_process(up, "celery", "-n inference-2-")
    os.kill(first, signal.SIGKILL)
    wait_text(lambda: up.err, "llmpipe up: inference-1 was killed by SIGKILL after", up)
    line = next(ln for ln in up.err.splitlines() if "inference-1 was killed by SIGKILL" in ln)
    assert line.endswith("; restarting in 1 s (crash 1 of 5 in 300 s)"), line
    # the other one serves meanwhile, and was not touched
    assert job_result(up.url, submit_job(up.url, body), timeout=120)["status"] == "succeeded"
    assert one_process(up, "celery", "-n inference-2-") == second
    assert "inference-2 was killed" not in up.err
    assert one_process(up, "celery", "-n inference-1-") != first
    # Ctrl-C a steady stack: inference-1's successor has loaded its engine (its log has its own
    # "ready." line after its predecessor's), so that no engine load shares the two cores with
    # the shutdown that vLLM's client gives 5 s (the last assertion). An engine core's exit
    # beside such a load and a Docker build took over 5 s here.
    log1 = tmp_path / "state" / "logs" / "inference-1.log"
    wait_until(lambda: log1.read_text().count("@llmpipe ready.") >= 2, 420, what="inference-1's successor ready")

    assert up.interrupt() == 0, up.err[-3000:]
    assert up.err.rstrip().endswith("stopped") and up.left_alive() == []
    assert "Traceback" not in up.err
    # The engine core of the worker that served throughout exited by itself once its engine
    # shut down; vLLM's client kills one still there 5 s after its SIGTERM (llmpipe/engines/
    # vllm_core_guard.py).
    log = (tmp_path / "state" / "logs" / "inference-2.log").read_text()
    assert "[shutdown] MPClient: complete" in log and "force killing" not in log, log[-3000:]
