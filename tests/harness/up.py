"""`llmpipe up` driven as a user runs it.

``Up`` (tests/llmpipe/local/test_up*.py, through their ``ups`` fixture): one real subprocess
on the tests' engine, its output files and every process it ever had, and the helpers those
tests share: jobs through the API, `llmpipe chat`, Flower, waiting for console text, the
queues of a stopped pipeline, a startup that must fail, and one process of the stack by name.

``UpPipe`` (the kill matrix, through ``rel.start_up``): `llmpipe up` on the shipped defaults,
driven through the same interface as tests/harness/pipe.py's ``Pipe``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import psutil
import redis

from llmpipe.local.redis_server import EmbeddedRedis, free_port
from llmpipe.local.supervisor import alive, descendants
from llmpipe.observability import readiness
from llmpipe.settings import Settings
from llmpipe.stages import STAGE_QUEUES
from llmpipe.testing import faulty
from tests.harness.engine import TEST_ENGINE_ENV
from tests.harness.pipe import Pipe
from tests.harness.waiting import poll, wait_until

ROOT = Path(__file__).resolve().parents[2]
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
        """Until `llmpipe up` says it is ready (then /healthz must answer 200); fails at once
        when it exits."""
        def ready() -> bool:
            self.collect()
            if "llmpipe is ready" in self.out:
                return True
            assert self.proc.poll() is None, f"llmpipe up exited {self.proc.returncode}:\n{self.err[-3000:]}"
            return False

        if not poll(ready, timeout, every=0.3):
            raise AssertionError(f"not ready after {timeout}s:\n{self.err[-3000:]}")
        assert httpx.get(f"{self.url}/healthz", timeout=5).status_code == 200
        self.collect()

    def wait(self, timeout: float) -> int:
        """Its exit code, collecting its processes meanwhile; TimeoutExpired after ``timeout``."""
        end = time.monotonic() + timeout
        def exited() -> bool:
            self.collect()
            return self.proc.poll() is not None

        poll(exited, timeout, every=0.2)
        return self.proc.wait(max(0.1, end - time.monotonic()))

    def interrupt(self, timeout: float = 120) -> int:
        self.collect()
        self.proc.send_signal(signal.SIGINT)
        return self.wait(timeout)

    def left_alive(self, grace: float = 5.0) -> list[str]:
        """Its processes still alive ``grace`` seconds after the last of them should have gone."""
        poll(lambda: not any(alive(p) for p in self.tree), grace, every=0.1)
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


def run_chat(url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "chat", "--url", url, "--max-tokens", "16", *args, QUESTION],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def flower_json(up: Up, path: str, auth) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{up.flower_port}{path}", auth=auth, timeout=30)


def wait_text(read, text: str, up: Up, timeout: float = 30) -> None:
    """Until ``read()`` holds ``text``; fails when ``up`` exits first or after ``timeout``."""
    def seen() -> bool:
        if text in read():
            return True
        assert up.proc.poll() is None, f"no {text!r}:\n{up.err[-3000:]}"
        return False

    assert poll(seen, timeout), f"no {text!r}:\n{up.err[-3000:]}"


def queued_in(state_dir: Path) -> dict[str, int]:
    """Messages waiting in each stage queue of the stopped pipeline's AOF."""
    with EmbeddedRedis(state_dir / "redis") as server:
        r = redis.Redis.from_url(server.url)
        try:
            return {q: sum(r.llen(k) for k in r.keys(f"{q}*") if r.type(k) == b"list") for q in STAGE_QUEUES}
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
    def matching() -> list[int]:
        return [p for p in descendants(up.proc.pid) if alive(p) and all(w in cmdline(p) for w in words)]

    def one() -> list[int] | None:
        pids = matching()
        return pids if len(pids) == 1 else None

    pids = poll(one, 60, every=0.2) or matching()
    assert len(pids) == 1, f"{len(pids)} processes match {words}: {[cmdline(p) for p in pids]}"
    return pids[0]


# -- `llmpipe up` on the shipped defaults (the kill matrix) ----------------------------------
class UpPipe(Pipe):
    """``llmpipe up`` run as a user runs it: a subprocess on the shipped defaults, its
    children found by their command lines (the test never restarts one: the supervisor does)."""

    def __init__(self, proc: subprocess.Popen, s: Settings, redis_server: EmbeddedRedis, out: Path):
        self.proc = proc
        self.out = out  # the console of `llmpipe up`
        super().__init__(SimpleNamespace(s=s, api_url=f"http://127.0.0.1:{s.api_port}"), redis_server)

    def children(self) -> dict[str, psutil.Process]:
        out = {}
        try:
            kids = psutil.Process(self.proc.pid).children()
        except psutil.Error:
            return out
        for p in kids:
            try:
                cmd = p.cmdline()
            except psutil.Error:
                continue
            if "api" in cmd and "llmpipe.cli" in cmd:
                out["api"] = p
            for kind in ("preprocess", "inference", "postprocess"):
                if self.node(kind) in cmd:
                    out[kind] = p
        return out

    def pid(self, kind: str) -> int:
        return self.children()[kind].pid

    def alive(self, kind: str) -> bool:
        return kind in self.children()

    def process_tree(self) -> dict[str, list[psutil.Process]]:
        out = {}
        for name, p in self.children().items():
            try:
                out[name] = [p, *p.children(recursive=True)]
            except psutil.Error:
                pass
        return out

    def log(self, kind: str) -> str:
        return (self.s.state_dir / "logs" / f"{kind}.log").read_text(errors="replace")

    def console(self) -> str:
        return self.out.read_text(errors="replace")

    def ready(self, kind: str) -> bool:
        """The child of ``kind`` serves: a worker is warm (its readiness keys are set, the
        inference worker's once its engine loaded: llmpipe/observability/readiness.py) and
        answers its ping; the API answers its /healthz."""
        if kind == "api":
            try:
                return self.http.get("/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False
        if not self._ready_keys(kind):
            return False
        try:
            return bool(self.probe.control.ping(destination=[self.node(kind)], timeout=0.5))
        except Exception:
            return False

    def _ready_keys(self, kind: str) -> list[bytes]:
        return list(self.r.scan_iter(readiness.key("*", self.node(kind))))

    def forget_ready(self, kind: str) -> None:
        """Drop a killed worker's readiness keys (they outlive it by up to their TTL), so that
        ready() waits for its successor to warm. A ping alone is no proof: on RabbitMQ one
        was answered 2.8 s after a SIGKILL of the inference worker whose jobs then waited
        62 s for the successor's engine."""
        for k in self._ready_keys(kind):
            self.r.delete(k)

    def stop(self) -> None:
        self.http.close()
        self.probe.close()
        if self.amqp is not None:
            self.amqp.release()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # Ctrl-C: the warm shutdown
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def start_up(tmp_path: Path, *, model: str, engine: str = "vllm", broker_url: str | None = None,
             ready_timeout: float = 600) -> UpPipe:
    """``llmpipe up --model M --engine E --no-flower`` on this test's own Redis and port, with
    nothing else set: no LLMPIPE_* variable but the broker's URL and the engine ledger (the
    test-only fault injector counting engine runs; it injects nothing unless asked), and
    vLLM's own multiprocessing (its engine core in a process of its own, as users run it)."""
    server = EmbeddedRedis(tmp_path / "redis", appendonly=False).start()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMPIPE_") and k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.update(faulty.env({"ledger": True}))
    if broker_url:
        env["LLMPIPE_BROKER_URL"] = broker_url
    env["PYTHONPATH"] = str(ROOT)
    out = tmp_path / "up.out"
    argv = [*CLI, "up", "--model", model, "--engine", engine, "--no-flower",
            "--redis-url", server.url, "--port", str(port), "--state-dir", str(tmp_path)]
    with open(out, "w") as f:
        proc = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    s = Settings(redis_url=server.url, broker_url=broker_url, api_port=port, state_dir=tmp_path)
    up = UpPipe(proc, s, server, out)
    try:
        wait_until(lambda: proc.poll() is not None or "llmpipe is ready" in up.console(), ready_timeout,
                   every=0.5, what="llmpipe up to be ready")
        if proc.poll() is not None:
            raise AssertionError(f"llmpipe up exited with {proc.returncode}: {up.console()[-3000:]}")
    except BaseException:
        stop_up(up)
        raise
    return up


def stop_up(up: UpPipe) -> None:
    try:
        up.stop()
    finally:
        up.redis_server.stop()
