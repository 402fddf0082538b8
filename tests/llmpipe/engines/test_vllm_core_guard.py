"""vLLM's engine-core process dies with its inference worker: a worker started alone (as on
another host, no supervisor anywhere) with vLLM's default multiprocessing, killed with
SIGKILL, leaves no ``VLLM::EngineCore`` behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmpipe.local.supervisor import alive, descendants
from tests.harness.engine import TEST_ENGINE_ENV

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _wait(pred, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the worker exited with {proc.returncode}:\n{log.read_text()[-3000:] if log else ''}")
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def test_engine_core_dies_with_a_killed_worker(tmp_path, redis_url, tiny_model):
    pytest.importorskip("vllm")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMPIPE_")}
    env.update(TEST_ENGINE_ENV)
    env.update({
        "PYTHONPATH": str(ROOT), "LLMPIPE_REDIS_URL": redis_url, "LLMPIPE_MODEL": tiny_model,
        "LLMPIPE_ENGINE": "vllm", "LLMPIPE_STATE_DIR": str(tmp_path),
        "LLMPIPE_MAX_BATCH_SIZE": "2", "LLMPIPE_MAX_MODEL_LEN": "512",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",  # vLLM's default: the engine core in its own process
        "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
    })
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    log = tmp_path / "worker.log"
    with log.open("w") as out:
        # Its own session, so the kill below reaches the worker's main process only, as
        # `kill -9 <pid>` by an operator or the OOM killer does.
        worker = subprocess.Popen([sys.executable, "-m", "llmpipe.cli", "worker", "inference", "-n",
                                   f"guard-{os.getpid()}@%h"], cwd=ROOT, env=env, stdout=out,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    cores: list[int] = []
    below_names: dict[int, str] = {}
    try:
        _wait(lambda: "engine ready" in log.read_text(), 300, "the engine to load", worker, log)
        below = descendants(worker.pid)
        cores += [p for p in below if "EngineCore" in _cmdline(p)]
        assert cores, f"no engine-core process under the worker: {[_cmdline(p) for p in below]}"
        below_names = {p: _cmdline(p)[:80] for p in below}
        os.kill(worker.pid, signal.SIGKILL)
        t0 = time.monotonic()
        worker.wait(10)
        _wait(lambda: not any(alive(p) for p in cores), 5, f"the engine core {cores} to die")
        print(f"\nengine core gone {time.monotonic() - t0:.2f} s after its worker was killed")
        # Nor anything below it (vLLM's executor workers, multiprocessing's helpers).
        gone: dict[str, float] = {}

        def all_gone() -> bool:
            for p in below:
                if below_names[p] not in gone and not alive(p):
                    gone[below_names[p]] = round(time.monotonic() - t0, 2)
            return len(gone) == len(below)

        _wait(all_gone, 5, f"every process the worker started to die: {[below_names[p] for p in below if alive(p)]}")
        print(f"seconds from the kill to each process below it gone: {gone}")
    finally:
        for pid in [worker.pid, *descendants(worker.pid), *cores, *below_names]:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        worker.wait(10)
