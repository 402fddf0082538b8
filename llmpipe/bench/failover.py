"""The failover figure of ``llmpipe bench --modes multiworker``: ``llmpipe up --inference-workers
N`` run as a user runs it (a subprocess on the shipped defaults, nothing else set but the
broker), ``jobs`` jobs in flight on every worker, ``kill -9`` of the first inference worker's
main process; the time from the kill to the last job done (the job records' terminal
writes), and whether every job succeeded. A control run first (other prompts of the same
shape, no kill) times the same moment to the last job done, so the figure also shows what
the failover adds to the time the backlog takes anyway. The supervisor restarts the killed
worker; the figure does not wait for it: the other workers finish the jobs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import redis
from rich.console import Console

from llmpipe.bench.prompts import make_prompts
from llmpipe.jobs.store import JobStore
from llmpipe.local.redis_server import EmbeddedRedis, free_port
from llmpipe.local.supervisor import descendants
from llmpipe.routing.keys import LOAD_KEY
from llmpipe.stages import Stage, worker_queue

TERMINAL = {"succeeded", "failed", "expired", "cancelled"}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def start_up(model: str, workers: int, state: Path, broker_url: str | None, extra_env: dict[str, str] | None = None,
             ready_timeout: float = 1800):
    """``llmpipe up`` on a Redis of its own: (process, API port, Redis, console file).
    ``extra_env``: settings beyond the shipped defaults (the smoke profile's faster engine)."""
    server = EmbeddedRedis(state / "redis", appendonly=False).start()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMPIPE_")}
    env.update(extra_env or {})
    if broker_url:
        env["LLMPIPE_BROKER_URL"] = broker_url
    console = state / "up.out"
    argv = [sys.executable, "-m", "llmpipe.cli", "up", "--model", model, "--inference-workers", str(workers),
            "--no-flower", "--quiet", "--redis-url", server.url, "--port", str(port), "--state-dir", str(state)]
    with open(console, "w") as f:
        proc = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    end = time.monotonic() + ready_timeout
    while time.monotonic() < end and proc.poll() is None and "llmpipe is ready" not in console.read_text():
        time.sleep(0.5)
    if proc.poll() is not None or "llmpipe is ready" not in console.read_text():
        stop_up(proc, server)
        raise RuntimeError(f"llmpipe up did not get ready: {console.read_text()[-2000:]}")
    return proc, port, server, console


def stop_up(proc: subprocess.Popen, server: EmbeddedRedis) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: the warm shutdown
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    server.stop()


def _worker_pid(up_pid: int, node: str) -> int:
    """The worker's main process: the first of ``llmpipe up``'s processes named for ``node``."""
    return min(p for p in descendants(up_pid) if node in _cmdline(p).split())


def _loads(r: redis.Redis, queues: list[str]) -> list[int]:
    return [int(v or 0) for v in r.hmget(LOAD_KEY, queues)]


def _wait_done(store: JobStore, jobs: list[str], timeout: float) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        recs = {j: store.get(j) for j in jobs}
        if all(r is not None and r.status.value in TERMINAL for r in recs.values()):
            return recs
        time.sleep(0.2)
    raise RuntimeError(f"jobs not done after {timeout:.0f}s")


def failover(o: Any, broker: str, broker_url: str | None, state: Path, console: Console) -> dict:
    """One broker's figure (``o``: llmpipe/bench/multiworker.py MultiOptions)."""
    from transformers import AutoTokenizer

    from llmpipe.models.registry import resolve_model
    from llmpipe.settings import Settings

    # The model's folder in the user's models dir (built there once, as the routing figure's
    # stacks use it): `llmpipe up` gets the folder, so that its own state dir does not build
    # the model a second time.
    model_path = resolve_model(o.model, Settings().models_dir, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    console.print(f"[bold]failover[/] ({broker}): llmpipe up --inference-workers {o.workers}")
    given = {**o.extra, **({"kv_cache_gib": o.kv_cache_gib} if o.kv_cache_gib is not None else {})}
    extra = {f"LLMPIPE_{k.upper()}": str(v).lower() if isinstance(v, bool) else str(v) for k, v in given.items()}
    proc, port, server, _ = start_up(model_path, o.workers, state, broker_url, {**extra, **o.env})
    try:
        r = redis.Redis.from_url(server.url)
        nodes = [f"{Stage.INFERENCE.value}-{i}-{port}@llmpipe" for i in range(1, o.workers + 1)]
        queues = [worker_queue(Stage.INFERENCE.value, n) for n in nodes]
        api = f"http://127.0.0.1:{port}"
        # Prompts of other seeds for the two runs: the kill run must not find the control's
        # prompts in the prefix cache.
        control_bodies, bodies = ([{"prompt": p, "max_tokens": o.failover_max_tokens, "temperature": 1.0,
                                    "ignore_eos": True} for p in make_prompts(tokenizer, o.failover_jobs, 128, seed=s)]
                                  for s in (4, 3))
        store = JobStore(r, 3600)
        with httpx.Client(base_url=api, timeout=60) as http:
            # The control: jobs of the same shape with no kill, so that the figure shows what
            # the failover adds to the time the backlog takes anyway.
            _, t_control, control = _in_flight(http, r, queues, control_bodies, store, None)
            held, t_kill, recs = _in_flight(http, r, queues, bodies, store, _worker_pid(proc.pid, nodes[0]))
    finally:
        stop_up(proc, server)
    statuses = [rec.status.value for rec in recs.values()]
    kill_s, control_s = _last(recs) - t_kill, _last(control) - t_control
    return {"broker": broker, "jobs": len(recs), "succeeded": statuses.count("succeeded"), "held_at_kill": held,
            "kill_to_last_done_s": round(kill_s, 2), "control_last_done_s": round(control_s, 2),
            "added_by_failover_s": round(kill_s - control_s, 2), "workers": o.workers,
            "max_tokens": o.failover_max_tokens, "settings": {**given, **o.env} or "the shipped defaults",
            "goal_s": 6.0}


def _in_flight(http: httpx.Client, r: redis.Redis, queues: list[str], bodies: list[dict], store: JobStore,
               victim: int | None) -> tuple[list[int], float, dict[str, Any]]:
    """Submits ``bodies``; once every worker holds some, ``kill -9`` of ``victim`` (None: the
    control, no kill). Returns (held per worker then, that moment, the terminal records)."""
    jobs = [http.post("/v1/jobs", json=b).json()["id"] for b in bodies]
    end = time.monotonic() + 120
    while time.monotonic() < end and not all(_loads(r, queues)):
        time.sleep(0.05)
    held, t = _loads(r, queues), time.time()
    if victim is not None:
        os.kill(victim, signal.SIGKILL)  # the process alone, as `kill -9 PID` does
    return held, t, _wait_done(store, jobs, 600)


def _last(recs: dict[str, Any]) -> float:
    return max(rec.updated_at or 0.0 for rec in recs.values())
