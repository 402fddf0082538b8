"""`llmpipe up --engine-arg KEY=VALUE` reaches vLLM: a real `up` on the tiny model with
`max_model_len=128` passed as an engine argument. vLLM starts with it (its own config line
in the inference log), the preprocess stage refuses a request that does not fit in it, and
one that fits is served. A misspelt argument stops `up` before anything starts.

The engine is the tests' (float32, eager: tests/harness/engine.py): what is tested is the
argument's way to vLLM, not the shipped engine settings, whose compile took this test
128 s of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from llmpipe.local.redis_server import free_port
from tests.harness.engine import TEST_ENGINE_ENV

ROOT = Path(__file__).resolve().parents[3]
CLI = [sys.executable, "-m", "llmpipe.cli"]


def _env(state_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMPIPE_")}
    return {**env, "LLMPIPE_STATE_DIR": str(state_dir), "HF_HUB_OFFLINE": "1", **TEST_ENGINE_ENV}


def _job(url: str, body: dict, timeout: float = 180) -> dict:
    r = httpx.post(f"{url}/v1/jobs", json=body, timeout=10)
    assert r.status_code == 202, r.text
    job_id, end = r.json()["id"], time.monotonic() + timeout
    while True:
        view = httpx.get(f"{url}/v1/jobs/{job_id}", params={"wait": 10}, timeout=30).json()
        if view["status"] not in ("queued", "running") or time.monotonic() > end:
            return view


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_engine_arg_max_model_len_takes_effect(tmp_path, tiny_model):
    state, port = tmp_path / "state", free_port()
    state.mkdir()
    out, err = (state / "up.out").open("w"), (state / "up.err").open("w")
    proc = subprocess.Popen([*CLI, "up", "--model", tiny_model, "--engine", "vllm", "--engine-arg", "max_model_len=128",
                             "--redis-url", "embedded", "--no-flower", "--cpu-workers", "1", "--quiet", "--port", str(port)],
                            cwd=ROOT, env=_env(state), stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 420
        while "llmpipe is ready" not in (state / "up.out").read_text():
            assert proc.poll() is None, (state / "up.err").read_text()[-3000:]
            assert time.monotonic() < end, "not ready: " + (state / "up.err").read_text()[-3000:]
            time.sleep(0.5)
        # vLLM itself was built with it (its config line), not only our settings.
        log = (state / "logs" / "inference.log").read_text()
        assert "max_seq_len=128," in log, log[-3000:]

        too_long = _job(url, {"prompt": "word " * 100, "max_tokens": 64, "temperature": 0})
        assert too_long["status"] == "failed", too_long
        assert too_long["error"]["type"] == "context_length_exceeded"
        assert "context length of 128 tokens" in too_long["error"]["message"]

        fits = _job(url, {"prompt": "word " * 10, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert fits["status"] == "succeeded", fits
        assert fits["result"]["results"][0]["completion_tokens"] == 8
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        out.close()
        err.close()


def test_misspelt_engine_arg_stops_up_before_anything_starts(tmp_path):
    result = subprocess.run([*CLI, "up", "--no-flower", "--port", str(free_port()), "--redis-url", "embedded",
                             "--engine-arg", "tensor_paralel_size=2"], cwd=ROOT, env=_env(tmp_path / "state"),
                            capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert result.returncode == 1
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("llmpipe up: ")]
    assert lines == ["llmpipe up: unknown vLLM engine argument 'tensor_paralel_size' (did you mean "
                     "tensor_parallel_size?): not a field of vLLM's AsyncEngineArgs"], result.stderr
    assert not (tmp_path / "state" / "logs").exists()  # no child was started
