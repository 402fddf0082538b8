"""`llmpipe up` driven as a user runs it, for tests/llmpipe/test_up*.py: `Up` (one real
subprocess, its output files and every process it ever had) and the helpers those tests
share: jobs through the API, `llmpipe chat`, Flower, waiting for console text, the queues
of a stopped pipeline, a startup that must fail, and one process of the stack by name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from llmpipe.local.redis_server import EmbeddedRedis, free_port
from llmpipe.local.supervisor import alive, descendants
from tests.stacks import TEST_ENGINE_ENV

ROOT = Path(__file__).resolve().parents[3]
CLI = [sys.executable, "-m", "llmpipe.cli"]
QUESTION = "What is the capital of France?"


def up_env(state_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMPIPE_")}
    return {**env, "LLMPIPE_STATE_DIR": str(state_dir), "HF_HUB_OFFLINE": "1", **TEST_ENGINE_ENV, **extra}


class Up:
    """One `llmpipe up` subprocess, its output files, and every process it ever had."""

    def __init__(self, state_dir: Path, *args: str, **env: str):
        self.state_dir = state_dir
        self.port = free_port()
        self.flower_port = free_port()
        state_dir.mkdir(parents=True, exist_ok=True)
        n = len(list(state_dir.glob("up-*.out")))
        self.out_path, self.err_path = state_dir / f"up-{n}.out", state_dir / f"up-{n}.err"
        with self.out_path.open("w") as out, self.err_path.open("w") as err:
            self.proc = subprocess.Popen(
                [*CLI, "up", "--port", str(self.port), "--flower-port", str(self.flower_port), *args],
                cwd=ROOT, env=up_env(state_dir, **env), stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        self.tree: set[int] = set()
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def out(self) -> str:
        return self.out_path.read_text()

    @property
    def err(self) -> str:
        return self.err_path.read_text()

    def collect(self) -> set[int]:
        if self.proc.poll() is None:
            self.tree |= descendants(self.proc.pid)
        return self.tree

    def wait_ready(self, timeout: float = 240) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.collect()
            if "llmpipe is ready" in self.out:
                assert httpx.get(f"{self.url}/healthz", timeout=5).status_code == 200
                self.collect()
                return
            assert self.proc.poll() is None, f"llmpipe up exited {self.proc.returncode}:\n{self.err[-3000:]}"
            time.sleep(0.3)
        raise AssertionError(f"not ready after {timeout}s:\n{self.err[-3000:]}")

    def wait(self, timeout: float) -> int:
        end = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < end:
            self.collect()
            time.sleep(0.2)
        return self.proc.wait(max(0.1, end - time.monotonic()))

    def interrupt(self, timeout: float = 120) -> int:
        self.collect()
        self.proc.send_signal(signal.SIGINT)
        return self.wait(timeout)

    def left_alive(self, grace: float = 5.0) -> list[str]:
        end = time.monotonic() + grace
        while time.monotonic() < end and any(alive(p) for p in self.tree):
            time.sleep(0.1)
        return [f"{p}: {cmdline(p)}" for p in sorted(self.tree) if alive(p)]

    def kill(self) -> None:
        for pid in [self.proc.pid, *self.collect()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.wait(10)


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "?"


def submit_job(url: str, body: dict) -> str:
    r = httpx.post(f"{url}/v1/jobs", json=body, timeout=10)
    assert r.status_code == 202, r.text
    return r.json()["id"]


def job_result(url: str, job_id: str, timeout: float = 120) -> dict:
    end = time.monotonic() + timeout
    while True:
        view = httpx.get(f"{url}/v1/jobs/{job_id}", params={"wait": 10}, timeout=30).json()
        if view["status"] not in ("queued", "running") or time.monotonic() > end:
            return view
        time.sleep(0.1)


def run_chat(url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "chat", "--url", url, "--max-tokens", "16", *args, QUESTION],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def flower_json(up: Up, path: str, auth) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{up.flower_port}{path}", auth=auth, timeout=30)


def wait_text(read, text: str, up: Up, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while text not in read():
        assert time.monotonic() < end and up.proc.poll() is None, f"no {text!r}:\n{up.err[-3000:]}"
        time.sleep(0.05)


def queued_in(state_dir: Path) -> dict[str, int]:
    """Messages waiting in each stage queue of the stopped pipeline's AOF."""
    with EmbeddedRedis(state_dir / "redis") as server:
        import redis

        r = redis.Redis.from_url(server.url)
        try:
            return {q: sum(r.llen(k) for k in r.keys(f"{q}*") if r.type(k) == b"list")
                    for q in ("preprocess", "inference", "postprocess", "collect")}
        finally:
            r.close()


def run_up(tmp_path, *args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "up", "--no-flower", *args], cwd=ROOT, env=up_env(tmp_path / "state", **env),
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def error_line(result: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("llmpipe up: ")]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def one_process(up: Up, *words: str) -> int:
    """The pid of the one live process whose command line holds every word."""
    end = time.monotonic() + 60
    while True:
        pids = [p for p in descendants(up.proc.pid) if alive(p) and all(w in cmdline(p) for w in words)]
        if len(pids) == 1:
            return pids[0]
        assert time.monotonic() < end, f"{len(pids)} processes match {words}: {[cmdline(p) for p in pids]}"
        time.sleep(0.2)
