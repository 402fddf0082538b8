"""``llmpipe up``: everything in one command, with a warm shutdown on Ctrl-C.

Redis (the configured one when it answers, else an embedded redis-server with its AOF
under the state dir), the model (prepared once into the state dir), one Celery worker per
stage, the API and Flower, as supervised children. A child that exits on its own is
restarted, its process group killed first, after a backoff (llmpipe/local/restarts.py); one that
crashes restart_max_crashes times within restart_window_s stops the stack with exit 1, as
does a child that cannot start as configured. Ctrl-C: a warm shutdown in pipeline order
(running requests finish; queued work stays in Redis for the next start), with no restart;
a second Ctrl-C forces it. Every way out stops every child and the embedded Redis.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from llmpipe.broker.redis_clients import safe_url
from llmpipe.engines.platform import check_engine_args
from llmpipe.engines.vllm_args import EngineArgError
from llmpipe.local.pipeline import LocalPipeline, PipelineError, inference_children, worker_gpus
from llmpipe.local.placement import WATCHER_NICE
from llmpipe.local.redis_server import EmbeddedRedis, port_in_use, redis_answers
from llmpipe.models.registry import resolve_model
from llmpipe.settings import Settings

EMBEDDED = "embedded"
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Interrupted(BaseException):
    """Ctrl-C before any child started (a BaseException, like KeyboardInterrupt, so that
    no ``except Exception`` on the way swallows it)."""


def child_env(s: Settings) -> dict[str, str]:
    """Environment defaults for the children; a variable already set in the environment wins.

    VLLM_ENABLE_V1_MULTIPROCESSING stays vLLM's default (1) on purpose. With 0, vLLM on
    CPU runs the model in its engine-core process without its OMP thread binding: measured
    with SmolLM2 on a 2-core machine, the engine started a little sooner (14-26 s instead
    of 29-30 s) but served 5-10x slower (one chat 12-16 s instead of 1.4-1.7 s; 16 prompts x
    64 tokens 10-14 s instead of 2.2-2.3 s). The engine sets VLLM_CPU_KVCACHE_SPACE from
    settings.kv_cache_gib and VLLM_HOST_IP itself; setting the latter here also covers its
    engine-core process.
    """
    env = {
        "VLLM_HOST_IP": "127.0.0.1",  # vLLM's own sockets stay on loopback
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        # The CPU stages load their tokenizer before forking their pool.
        "TOKENIZERS_PARALLELISM": "false",
    }
    return {k: v for k, v in env.items() if k not in os.environ}


def check_model_path(path: str) -> None:
    p = Path(path)
    if p.is_dir() and not (p / "config.json").is_file():
        raise PipelineError(f"model folder {path} has no config.json: not a Hugging Face model folder")


def run_up(s: Settings, *, flower: bool = True, echo: bool = True, redis_explicit: bool = False,
           ready_timeout: float = 600.0, stop_timeout: float = 120.0, verbose: bool = False) -> int:
    console = Console(stderr=True, highlight=False, soft_wrap=True, markup=False)
    run = _Run(console, Console(highlight=False, soft_wrap=True))
    previous = {sig: signal.signal(sig, run.on_signal) for sig in _SIGNALS}
    code = 0
    try:
        code = run.serve(s, flower=flower, echo=echo, verbose=verbose, redis_explicit=redis_explicit,
                         ready_timeout=ready_timeout)
    except _Interrupted:
        console.print("llmpipe up: interrupted", style="yellow")
        code = 130
    except PipelineError as exc:
        console.print(f"llmpipe up: {exc}", style="red")
        code = 1
    except Exception as exc:  # a bug: still one line, and still a clean stop
        if os.environ.get("LLMPIPE_DEBUG"):
            raise
        console.print(f"llmpipe up: unexpected {type(exc).__name__}: {exc} (LLMPIPE_DEBUG=1 shows the traceback)",
                      style="red")
        code = 1
    finally:
        code = run.stop(code, stop_timeout)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code


class _Run:
    """One ``llmpipe up``: what it started (the pipeline, an embedded Redis) and its
    signals (the first stops it warm, the second forces)."""

    def __init__(self, console: Console, out: Console):
        self.console = console
        self.out = out
        self.embedded: EmbeddedRedis | None = None
        self.pipeline: LocalPipeline | None = None
        self.force = threading.Event()
        self.stopping = threading.Event()
        self.started = time.monotonic()

    def on_signal(self, signum, frame) -> None:
        if self.stopping.is_set():
            if not self.force.is_set():
                self.console.print("forcing shutdown", style="red")
            self.force.set()
            return
        self.stopping.set()
        if self.pipeline is None:
            raise _Interrupted()

    def serve(self, s: Settings, *, flower: bool, echo: bool, verbose: bool, redis_explicit: bool,
              ready_timeout: float) -> int:
        """Start everything, then tend it until a signal; 130 when stopped before ready."""
        configured = _preflight(s, flower, redis_explicit, self.console)
        self.embedded, s = _redis(s, configured, self.console)
        if flower and not s.flower_password:
            s = s.model_copy(update={"flower_password": secrets.token_urlsafe(12)})
        # The console: our own lines and the children's warnings and errors; --verbose: everything.
        self.pipeline = LocalPipeline(s, flower=flower, echo=echo, console=self.console, extra_env=child_env(s),
                                      echo_level=logging.DEBUG if verbose else logging.WARNING, restarts=True)
        self.pipeline.start()
        with self.console.status("starting") as status:
            ready = self.pipeline.wait_ready(ready_timeout, status=status, stop_event=self.stopping)
        if ready:
            if self.embedded is not None and self.embedded.proc is not None:
                self.pipeline.place(self.embedded.proc.pid)
            _print_ready(self.out, s, flower, self.embedded, self.pipeline, time.monotonic() - self.started)
        while not self.stopping.is_set():
            self.pipeline.tend()  # restarts a child that exited on its own; raises when it gives up on one
            self.stopping.wait(0.2)
        return 0 if ready else 130

    def stop(self, code: int, stop_timeout: float) -> int:
        """Stop every child (warm, unless forced) and the embedded Redis; the exit code."""
        self.stopping.set()
        if self.pipeline is not None:
            if code in (0, 130):
                self.console.print("warm shutdown: running requests finish, queued jobs stay in Redis "
                                   "(Ctrl-C again to force)", style="yellow")
            if not self.pipeline.stop(timeout=stop_timeout, force_event=self.force):
                if not self.force.is_set():
                    self.console.print(f"not stopped after {stop_timeout:.0f}s: killed what was left", style="red")
                code = code or 130
        if self.embedded is not None:
            self.embedded.stop()
        if self.pipeline is not None or self.embedded is not None:
            self.console.print("stopped" + (" (forced)" if self.force.is_set() else ""))
        return code


def _preflight(s: Settings, flower: bool, redis_explicit: bool, console: Console) -> bool:
    """What can be checked before anything starts: the ports, the configured Redis (whether
    it answers), the engine arguments and every served model, prepared once here before its
    workers start (llmpipe/models/served.py). The quick checks go first: checking engine
    arguments imports vLLM (seconds), and preparing a model may download it."""
    for port, what, flag in [(s.api_port, "API", "--port"), *([(s.flower_port, "Flower", "--flower-port")] if flower else [])]:
        if port_in_use(port):
            raise PipelineError(f"port {port} for the {what} is already in use (choose another with {flag})")
    configured = _configured_redis(s, redis_explicit)
    _check_engine_args(s)
    gpus = worker_gpus(s)  # several workers of a model: GPUs of their own, which must fit
    for m in s.served.models:
        try:
            model_path = resolve_model(m.source, s.models_dir, progress=True)
        except Exception as exc:
            raise PipelineError(f"model {m.source}: {exc}") from None
        check_model_path(model_path)
        queue = f", queue {m.queue}" if s.served.several else ""
        console.print(f"model: {m.id} ({model_path}{queue}); engine: {s.engine.value}{_workers_line(s, m, gpus)}")
    return configured


def _workers_line(s: Settings, m, gpus: dict[str, str]) -> str:
    """``; 2 inference workers (GPUs 0 and 1), prefix-aware routing`` for a model with several."""
    n = s.workers_of(m.name)
    if n == 1:
        return ""
    mine = [gpus[c] for c, model in inference_children(s) if c in gpus and (model or s.served.default.name) == m.name]
    where = f" (GPUs {' and '.join(mine)})" if mine else " (sharing the CPU)" if not gpus else ""
    routing = "prefix-aware routing" if s.prefix_routing else "one shared queue (prefix_routing off)"
    return f"; {n} inference workers{where}, {routing}"


def _check_engine_args(s: Settings) -> None:
    """A typo in an engine argument is one line now, not an engine that fails to start later."""
    try:
        check_engine_args(s)
    except EngineArgError as exc:
        raise PipelineError(str(exc)) from None


def _safe(url: str) -> str:
    """The URL without its password (every part of a Sentinel URL)."""
    return safe_url(url)


def _configured_redis(s: Settings, explicit: bool) -> bool:
    """Whether the configured Redis answers; an explicit one (flag, env, config file)
    that does not is an error, not a reason to embed one."""
    if s.redis_url == EMBEDDED:
        return False
    if redis_answers(s.redis_url, master_name=s.redis_sentinel_master):
        return True
    if explicit:
        raise PipelineError(f"redis at {_safe(s.redis_url)} does not answer (leave --redis-url out, or "
                            f"use --redis-url {EMBEDDED}, for an embedded Redis)")
    return False


def _redis(s: Settings, configured: bool, console: Console) -> tuple[EmbeddedRedis | None, Settings]:
    """The Redis to use, said in one line: the configured one when it answers, else an
    embedded one (always with ``--redis-url embedded``) with its AOF in the state dir."""
    if configured:
        console.print(f"redis: using {_safe(s.redis_url)}")
        return None, s
    try:
        embedded = EmbeddedRedis(s.state_dir / "redis").start()
    except RuntimeError as exc:
        raise PipelineError(f"embedded redis: {exc}") from None
    why = "" if s.redis_url == EMBEDDED else f"; {_safe(s.redis_url)} did not answer"
    console.print(f"redis: embedded redis-server at {embedded.url} (AOF in {embedded.data_dir}){why}")
    return embedded, s.model_copy(update={"redis_url": embedded.url})


def _cli_name() -> str:
    exe = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if exe and shutil.which("llmpipe") == exe:
        return "llmpipe"
    if exe.endswith("llmpipe") and os.path.isfile(exe):
        rel = os.path.relpath(exe)
        return rel if not rel.startswith("..") else exe
    return "llmpipe"


def _with_workers(s: Settings, m) -> str:
    n = s.workers_of(m.name)
    return m.id if n == 1 else f"{m.id} x{n} inference workers"


def _print_ready(out: Console, s: Settings, flower: bool, embedded: EmbeddedRedis | None,
                 pipeline: LocalPipeline, took: float) -> None:
    api = f"http://127.0.0.1:{s.api_port}"
    body = ('{"messages": [{"role": "user", "content": "What is the capital of France?"}], '
            '"max_tokens": 32, "temperature": 0}')
    url_opt = "" if s.api_port == 8000 else f" --url {api}"
    lines = [
        "[bold green]llmpipe is ready[/] " + escape(f"in {took:.1f}s ({'models' if s.served.several else 'model'} "
                                                    f"{', '.join(_with_workers(s, m) for m in s.served.models)}, "
                                                    f"engine {s.engine.value})"),
        f"  API      {api}   docs: {api}/docs",
    ]
    if flower:
        lines.append(f"  Flower   http://127.0.0.1:{s.flower_port}   user {s.flower_user}, password {s.flower_password}")
    lines += [
        f"  Redis    {_safe(s.redis_url)}" + (" (embedded)" if embedded else ""),
        f"  Logs     {pipeline.sup.log_dir}",
        *_cpus_line(pipeline),
        "  Try:",
        f"    curl -s {api}/v1/jobs -H 'content-type: application/json' -d '{body}'",
        f"    curl -s '{api}/v1/jobs/<id>?wait=30'",
        f"    {_cli_name()} chat{url_opt} \"What is the capital of France?\"",
        "  Ctrl-C stops (warm: running requests finish, queued ones wait in Redis); twice forces.",
    ]
    out.print("\n".join([lines[0], *map(escape, lines[1:])]), markup=True, highlight=False)


def _cpus_line(pipeline: LocalPipeline) -> list[str]:
    """Where the processes run, when they are kept off the engine's CPUs (llmpipe/local/placement.py)."""
    p = pipeline.placement
    if p is None or p.cpus is None:
        return []
    cpus = ",".join(map(str, sorted(p.cpus)))
    engine = ",".join(map(str, sorted(p.engine)))
    flower = f" (Flower on {engine}, at nice {WATCHER_NICE})" if pipeline.flower else ""
    return [f"  CPUs     vLLM computes on {engine}; llmpipe's other processes run on {cpus}{flower}"]
