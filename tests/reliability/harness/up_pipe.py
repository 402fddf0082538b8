"""`llmpipe up` as a user runs it, driven through the same Pipe interface."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from types import SimpleNamespace

import httpx
import psutil

from llmpipe.local.redis_server import EmbeddedRedis, free_port
from llmpipe.settings import Settings
from llmpipe.testing import faulty
from tests.reliability.harness.common import wait_until
from tests.reliability.harness.pipe import Pipe


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
        """The child of ``kind`` serves: a worker answers its ping, the API its /healthz."""
        if kind == "api":
            try:
                return self.http.get("/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False
        try:
            return bool(self.probe.control.ping(destination=[self.node(kind)], timeout=0.5))
        except Exception:
            return False

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
    import sys

    server = EmbeddedRedis(tmp_path / "redis", appendonly=False).start()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMPIPE_") and k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.update(faulty.env({"ledger": True}))
    if broker_url:
        env["LLMPIPE_BROKER_URL"] = broker_url
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[3])
    out = tmp_path / "up.out"
    argv = [sys.executable, "-m", "llmpipe.cli", "up", "--model", model, "--engine", engine, "--no-flower",
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
