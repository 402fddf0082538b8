"""The serving modes the benchmark compares, and how each one's servers start and stop.

Every mode is real processes on loopback: the serial server, a whole LocalPipeline
(workers + API, on the bench's own embedded Redis), or ``vllm serve``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from llmpipe.local.redis_server import free_port
from llmpipe.settings import EngineKind, Settings


@dataclass(frozen=True)
class Mode:
    name: str
    kind: str  # "serial" | "pipeline" | "floor" | "vllm-serve"
    window_ms: float = 0.0
    batched: bool = True  # False: max batch 1
    about: str = ""


MODES: dict[str, Mode] = {m.name: m for m in [
    Mode("serial", "serial", 0, False, "one process tokenizes, generates and detokenizes one request at a time"),
    Mode("pipeline-nobatch", "pipeline", 0, False, "the Celery pipeline, max batch 1"),
    Mode("pipeline-window0", "pipeline", 0, True, "the pipeline, batching window 0 ms (batches form only while the engine is busy)"),
    Mode("pipeline-window50", "pipeline", 50, True, "the pipeline, dynamic batching with a 50 ms window"),
    Mode("pipeline-continuous", "pipeline", 0, True, "the pipeline, requests go to vLLM at once and join its running batch (continuous batching)"),
    Mode("vllm-serve", "vllm-serve", 0, True, "vLLM's own OpenAI server on the same model"),
    Mode("celery-floor", "floor", 0, True, "the floor: the same three stages as bare Celery no-op tasks (same pools, "
         "acks_late, JSON, task events) behind a minimal HTTP endpoint; no llmpipe bookkeeping"),
]}


@dataclass
class EngineSetup:
    """One engine of the run and what its servers need."""

    key: str  # "simulated" | "noop" | "real"
    kind: EngineKind
    label: str  # shown in every output; "SIMULATED" for the simulated engine
    model_path: str
    max_model_len: int
    max_batch: int = 32
    cpu_workers: int = 2
    sim: dict = field(default_factory=dict)  # sim_* Settings fields

    @property
    def burns(self) -> bool:
        return self.sim.get("sim_preprocess_cpu_ms", 0) > 0 or self.sim.get("sim_postprocess_cpu_ms", 0) > 0

    def settings(self, mode: Mode, redis_url: str, state_dir: Path) -> Settings:
        return Settings(
            redis_url=redis_url, model=self.model_path, engine=self.kind, state_dir=state_dir, api_port=free_port(),
            batch_window_ms=mode.window_ms, max_batch_size=self.max_batch if mode.batched else 1,
            max_model_len=self.max_model_len, kv_cache_gib=1.0, cpu_workers=self.cpu_workers,
            default_timeout_s=600.0, max_timeout_s=600.0, max_queue_depth=0, max_queued_prompt_tokens=0,
            max_prompt_chars=1_000_000, **self.sim,
        )


@dataclass
class Server:
    mode: Mode
    url: str
    protocols: tuple[str, ...]
    groups: dict[str, list[int]]  # CPU groups: name -> root pids
    log_dir: Path
    settings: Settings | None = None
    _stop: object = None

    def stop(self) -> None:
        if self._stop is not None:
            self._stop()
            self._stop = None


class ServerError(RuntimeError):
    pass


BASE_ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_CPU_KVCACHE_SPACE": "1"}


def _wait_http(url: str, sup, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        dead = sup.exited()
        if dead:
            last = next((ln for ln in reversed(dead[0].tail) if ln.strip()), "")
            raise ServerError(f"{what} exited with code {dead[0].proc.returncode}: {last[:300]} (log: {dead[0].log_path})")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise ServerError(f"{what} not ready after {timeout:.0f}s (logs in {sup.log_dir})")


def has_completions_endpoint() -> bool:
    """Whether the pipeline's API has POST /v1/completions (OpenAI-style, streaming)."""
    try:
        from api.app import create_app

        app = create_app(Settings(redis_url="redis://127.0.0.1:1/0"))
        return any(getattr(r, "path", None) == "/v1/completions" for r in app.routes)
    except Exception:
        return False


def start_server(mode: Mode, eng: EngineSetup, redis_url: str, log_dir: Path, *, ready_timeout: float = 900.0,
                 console=None) -> Server:
    from llmpipe.local.pipeline import LocalPipeline, settings_env
    from llmpipe.local.supervisor import Supervisor, python_env

    log_dir.mkdir(parents=True, exist_ok=True)
    s = eng.settings(mode, redis_url, log_dir / "state")
    env = dict(BASE_ENV)
    if mode.kind == "pipeline":
        if eng.burns:
            from llmpipe.bench.burn import LOADER

            env["CELERY_LOADER"] = LOADER
        p = LocalPipeline(s, flower=False, echo=False, console=console, extra_env=env, log_dir=log_dir).start()
        try:
            p.wait_ready(timeout=ready_timeout)
        except Exception as e:
            p.stop(timeout=10)
            raise ServerError(str(e)) from e
        groups = {c.name: [c.proc.pid] for c in p.sup.children}
        protocols = ("jobs", "openai") if has_completions_endpoint() else ("jobs",)
        return Server(mode, p.api_url, protocols, groups, log_dir, s, lambda: p.stop(timeout=30))

    sup = Supervisor(log_dir, console=console, echo=False)
    port = free_port()
    if mode.kind == "floor":
        return _start_floor(mode, s, env, sup, port, ready_timeout)
    if mode.kind == "serial":
        argv = [sys.executable, "-m", "llmpipe.bench.serial_server", "--port", str(port)]
        child = sup.spawn("serial", argv, python_env({**settings_env(s), **env}))
        protocols, probe = ("jobs", "openai"), "/healthz"
    elif mode.kind == "vllm-serve":
        if eng.kind is not EngineKind.VLLM:
            raise ServerError("vllm-serve runs only with the vLLM engine")
        from llmpipe.engines.platform import engine_config

        ea = engine_config(s).args  # what the pipeline's engine gets on this platform
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", eng.model_path,
                "--host", "127.0.0.1", "--port", str(port), "--dtype", str(ea["dtype"]),
                "--max-model-len", str(eng.max_model_len), "--seed", "0"]
        argv += ["--enforce-eager"] if ea.get("enforce_eager") else []
        argv += ["--max-num-seqs", str(ea["max_num_seqs"])] if ea.get("max_num_seqs") else []
        child = sup.spawn("vllm-serve", argv, python_env(env))
        protocols, probe = ("openai",), "/v1/models"
    else:
        raise ServerError(f"unknown mode kind {mode.kind}")
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http(url + probe, sup, ready_timeout, mode.name)
    except Exception:
        sup.stop(timeout=10)
        raise
    return Server(mode, url, protocols, {mode.kind: [child.proc.pid]}, log_dir, s, lambda: sup.stop(timeout=30))


def _start_floor(mode: Mode, s: Settings, env: dict, sup, port: int, ready_timeout: float) -> Server:
    """The celery-floor mode (llmpipe/bench/floor.py): a worker per stage, as the pipeline's, and its API."""
    from celery import Celery

    from llmpipe.bench.floor import QUEUES, floor_worker_argv
    from llmpipe.local.pipeline import settings_env
    from llmpipe.local.supervisor import python_env

    penv = python_env({**settings_env(s), **env})
    pids = {}
    for kind in QUEUES:
        pids[kind] = [sup.spawn(kind, floor_worker_argv(kind, s, name=f"floor-{kind}-{port}@llmpipe"), penv).proc.pid]
    pids["api"] = [sup.spawn("api", [sys.executable, "-m", "llmpipe.bench.floor", "--port", str(port)], penv).proc.pid]
    url = f"http://127.0.0.1:{port}"
    probe = Celery(broker=s.redis_url, backend=s.redis_url)
    try:
        _wait_http(url + "/healthz", sup, ready_timeout, mode.name)
        end = time.monotonic() + ready_timeout
        seen: set[str] = set()
        while not set(QUEUES) <= seen:
            if time.monotonic() > end or sup.exited():
                raise ServerError(f"{mode.name}: workers {sorted(set(QUEUES) - seen)} not ready (logs in {sup.log_dir})")
            seen = {n.split("@")[0].split("-")[1] for r in (probe.control.ping(timeout=0.5) or []) for n in r
                    if n.startswith("floor-")}
    except Exception:
        sup.stop(timeout=10)
        raise
    finally:
        probe.close()
    return Server(mode, url, ("jobs",), pids, sup.log_dir, s, lambda: sup.stop(timeout=30))
