"""The serving modes the benchmark compares, and how each one's servers start and stop.

Every mode is real processes on loopback: the serial server, a whole LocalPipeline
(workers + API, on the bench's own embedded Redis; Flower too where the plan says so,
``EngineSetup.flower``), the celery floor, or ``vllm serve``
(llmpipe/bench/vllm_serve.py: as a user types it, or with the pipeline's engine arguments).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from llmpipe.bench.burn import LOADER
from llmpipe.bench.vllm_serve import matched_argv, serve_argv
from llmpipe.local.pipeline import LocalPipeline, settings_env
from llmpipe.local.redis_server import free_port
from llmpipe.local.supervisor import Supervisor, python_env
from llmpipe.settings import EngineKind, Settings


@dataclass(frozen=True)
class Mode:
    name: str
    kind: str  # "serial" | "pipeline" | "floor" | "vllm-serve"
    window_ms: float = 0.0
    batched: bool = True  # False: max batch 1
    about: str = ""
    matched: bool = False  # vllm-serve: the pipeline's engine arguments instead of vLLM's defaults


MODES: dict[str, Mode] = {m.name: m for m in [
    Mode("serial", "serial", 0, False, "one process tokenizes, generates and detokenizes one request at a time"),
    Mode("pipeline-nobatch", "pipeline", 0, False, "the Celery pipeline, max batch 1"),
    Mode("pipeline-window0", "pipeline", 0, True, "the pipeline, batching window 0 ms (batches form only while the engine is busy)"),
    Mode("pipeline-window50", "pipeline", 50, True, "the pipeline as shipped (`make up`): dynamic batching with a 50 ms "
         "window, max batch 32; on vLLM, batches go to the engine while others run and join its running batch"),
    Mode("pipeline-continuous", "pipeline", 0, True, "the pipeline, batching window 0: requests go to vLLM at once and join its running batch (continuous batching)"),
    Mode("vllm-serve", "vllm-serve", 0, True, "`vllm serve MODEL` as a user types it: vLLM's own defaults, no flags but "
         "--host and --port"),
    Mode("vllm-serve-matched", "vllm-serve", 0, True, "`vllm serve` given the pipeline's effective engine arguments "
         "(the same engine as the pipeline's, so the difference is the pipeline's own overhead)", matched=True),
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
    max_model_len: int | None  # None: the model's own, as shipped (and as `vllm serve` picks it)
    max_batch: int = 32
    cpu_workers: int = 2
    sim: dict = field(default_factory=dict)  # sim_* Settings fields
    # The pipeline starts Flower too, as `llmpipe up` does: against `vllm serve` (the real
    # engine), its CPU is part of what a user's stack costs. Against the serial server and
    # the celery floor (noop, simulated), neither side runs a monitor.
    flower: bool = False

    @property
    def burns(self) -> bool:
        return self.sim.get("sim_preprocess_cpu_ms", 0) > 0 or self.sim.get("sim_postprocess_cpu_ms", 0) > 0

    def settings(self, mode: Mode, redis_url: str, state_dir: Path) -> Settings:
        return Settings(
            redis_url=redis_url, model=self.model_path, engine=self.kind, state_dir=state_dir, api_port=free_port(),
            flower_port=free_port(),
            batch_window_ms=mode.window_ms, max_batch_size=self.max_batch if mode.batched else 1,
            max_model_len=self.max_model_len, kv_cache_gib=1.0, cpu_workers=self.cpu_workers,
            default_timeout_s=600.0, max_timeout_s=600.0, max_queue_depth=0, max_queued_prompt_tokens=0,
            max_prompt_chars=1_000_000, **self.sim,
        )


# What each kind of server answers (llmpipe/bench/kinds.py endpoint): the job API, the
# OpenAI completions and chat endpoints.
ENDPOINTS = {"pipeline": ("jobs", "completions", "chat"), "serial": ("jobs", "completions"), "floor": ("jobs",),
             "vllm-serve": ("completions", "chat")}


@dataclass
class Server:
    mode: Mode
    url: str
    protocols: tuple[str, ...]  # ENDPOINTS
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


def start_server(mode: Mode, eng: EngineSetup, redis_url: str, log_dir: Path, *, ready_timeout: float = 900.0,
                 console=None) -> Server:
    log_dir.mkdir(parents=True, exist_ok=True)
    s = eng.settings(mode, redis_url, log_dir / "state")
    env = dict(BASE_ENV)
    if mode.kind == "pipeline":
        return _start_pipeline(mode, eng, s, env, log_dir, ready_timeout, console)
    sup = Supervisor(log_dir, console=console, echo=False)
    port = free_port()
    if mode.kind == "floor":
        return _start_floor(mode, s, env, sup, port, ready_timeout)
    if mode.kind == "serial":
        argv = [sys.executable, "-m", "llmpipe.bench.serial_server", "--port", str(port)]
        child = sup.spawn("serial", argv, python_env({**settings_env(s), **env}))
        probe = "/healthz"
    elif mode.kind == "vllm-serve":
        if eng.kind is not EngineKind.VLLM:
            raise ServerError(f"{mode.name} runs only with the vLLM engine")
        # The name the pipeline answers to; vLLM's is its model argument (serve_argv).
        name = s.served.default.id
        argv = matched_argv(eng.model_path, port, s, name) if mode.matched else serve_argv(eng.model_path, port, name)
        child = sup.spawn(mode.name, argv, python_env(env))
        probe = "/v1/models"
    else:
        raise ServerError(f"unknown mode kind {mode.kind}")
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http(url + probe, sup, ready_timeout, mode.name)
    except Exception:
        sup.stop(timeout=10)
        raise
    group = mode.name if mode.kind == "vllm-serve" else mode.kind
    return Server(mode, url, ENDPOINTS[mode.kind], {group: [child.proc.pid]}, log_dir, s, lambda: sup.stop(timeout=30))


def _start_pipeline(mode: Mode, eng: EngineSetup, s: Settings, env: dict, log_dir: Path, ready_timeout: float,
                    console) -> Server:
    if eng.burns:
        env["CELERY_LOADER"] = LOADER
    p = LocalPipeline(s, flower=eng.flower, echo=False, console=console, extra_env=env, log_dir=log_dir).start()
    try:
        p.wait_ready(timeout=ready_timeout)
    except Exception as e:
        p.stop(timeout=10)
        raise ServerError(str(e)) from e
    groups = {c.name: [c.proc.pid] for c in p.sup.children}
    return Server(mode, p.api_url, ENDPOINTS["pipeline"], groups, log_dir, s, lambda: p.stop(timeout=30))


def _start_floor(mode: Mode, s: Settings, env: dict, sup, port: int, ready_timeout: float) -> Server:
    """The celery-floor mode (llmpipe/bench/floor.py): a worker per stage, as the pipeline's, and its API."""
    from celery import Celery

    # Lazily: the floor module builds its own Celery app when imported.
    from llmpipe.bench.floor import QUEUES, floor_worker_argv

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
    return Server(mode, url, ENDPOINTS["floor"], pids, sup.log_dir, s, lambda: sup.stop(timeout=30))
