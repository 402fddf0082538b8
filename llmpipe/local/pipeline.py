"""A whole pipeline as local child processes: one worker per kind (``inference_workers`` per
served model for inference), the API, Flower.

Used by ``llmpipe up``, the benchmark and the integration tests, so all three run the
same real processes.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import sys
import threading
import time
from pathlib import Path

import httpx
from rich.console import Console

from llmpipe.broker.redis_clients import celery_probe
from llmpipe.local.devices import DeviceError, assign, own_gpus, visible_gpus
from llmpipe.local.placement import Placement
from llmpipe.local.placement import supported as placement_supported
from llmpipe.local.restarts import RestartPolicy
from llmpipe.local.supervisor import Child, Crash, Supervisor, how_exited, python_env
from llmpipe.settings import Settings
from llmpipe.stages import START_FAILURES, Stage
from workers.launch import KIND_ENV, node_of, worker_argv

# One worker per stage, in pipeline order (postprocess workers serve the chord callback too).
WORKER_KINDS = tuple(stage.value for stage in Stage)


log = logging.getLogger("llmpipe.local.pipeline")


class PipelineError(Exception):
    """A clear, one-line reason why the pipeline cannot serve."""


_CELERY_PREFIX = re.compile(r"^\[\d{4}-\d\d-\d\d [^\]]*\]\s*")


def _last_words(child: Child) -> str:
    """What a child's run said about its exit. Killed by a signal: nothing (the signal came
    from outside; its last line only says what it was doing before, which may be long
    over). Exited: its own ``llmpipe:`` line of this run if it printed one (an engine that
    cannot start), else its last line of output."""
    code = child.proc.returncode if child.proc else None
    if code is not None and code < 0:
        return ""
    lines = [_CELERY_PREFIX.sub("", ln.strip()) for ln in child.tail if ln.strip()]
    own = [ln for ln in lines if ln.startswith("llmpipe:")]
    last = own[-1].removeprefix("llmpipe:").strip() if own else (lines[-1] if lines else "")
    return last[:300]


def exit_reason(child: Child) -> str:
    """One line on why a child exited."""
    last = _last_words(child)
    how = how_exited(child.proc.returncode if child.proc else None)
    return f"{child.name} {how}" + (f": {last}" if last else "") + f" (log: {child.log_path})"


def _secs(s: float) -> str:
    return f"{s:.1f} s" if s < 10 else f"{s:.0f} s"


def crash_line(crash: Crash) -> str:
    """The console line for a supervised child that exited on its own, e.g. ``inference
    was killed by SIGKILL after 42 s; restarting in 1 s (crash 1 of 5 in 300 s)``."""
    d, c = crash.decision, crash.child
    last = _last_words(c)
    head = f"{c.name} {how_exited(crash.returncode)} after {_secs(crash.uptime_s)}" + (f" ({last})" if last else "")
    if d.give_up:
        return (f"{head}; {d.crashes} crashes within {d.window_s:g} s (restart_max_crashes={d.max_crashes}, "
                f"restart_window_s={d.window_s:g}): giving up on it (log: {c.log_path})")
    return f"{head}; restarting in {d.delay_s:g} s (crash {d.crashes} of {d.max_crashes} in {d.window_s:g} s)"


def settings_env(s: Settings) -> dict[str, str]:
    """The effective settings as LLMPIPE_* variables, so every child sees the same ones."""
    env = {}
    for name, value in s.model_dump(mode="json").items():
        if value is None:
            continue
        if isinstance(value, bool):
            value = str(value).lower()
        elif isinstance(value, (dict, list)):  # pydantic-settings reads JSON for these
            value = json.dumps(value)
        env[f"LLMPIPE_{name.upper()}"] = str(value)
    # These are all of them: a child that read the config file again would merge its
    # [engine_args] table into the effective one a second time.
    env["LLMPIPE_CONFIG"] = ""
    return env


def flower_argv(s: Settings, *, port: int | None = None, address: str = "127.0.0.1") -> list[str]:
    argv = [sys.executable, "-m", "celery", "-A", "tasks", "flower", f"--port={port or s.flower_port}",
            f"--address={address}", "--purge_offline_workers=60"]
    if s.flower_password:
        argv.append(f"--basic-auth={s.flower_user}:{s.flower_password}")
    return argv


def inference_children(s: Settings) -> list[tuple[str, str | None]]:
    """(child name, model) of every inference worker, model None with one served model."""
    out = []
    for m in s.served.models:
        base, n = node_of(Stage.INFERENCE.value, s, m.name), s.workers_of(m.name)
        model = m.name if s.served.several else None
        out += [(base if n == 1 else f"{base}-{i}", model) for i in range(1, n + 1)]
    return out


def worker_gpus(s: Settings) -> dict[str, str]:
    """Each inference worker's CUDA_VISIBLE_DEVICES when each has GPUs of its own
    (llmpipe/local/devices.py); PipelineError when they do not fit."""
    if not own_gpus(s):
        return {}
    try:
        return assign(s, [c for c, _ in inference_children(s)], visible_gpus())
    except DeviceError as exc:
        raise PipelineError(str(exc)) from None


FLOWER = "flower"  # the child that only watches (llmpipe/local/placement.py: apply_watcher)

# How long a restarted inference worker's engine may take to bind its CPUs (start-up,
# compiling cold included) before its own process is left where it started.
ENGINE_BIND_TIMEOUT_S = 900.0


class LocalPipeline:
    def __init__(self, settings: Settings, *, kinds: tuple[str, ...] = WORKER_KINDS, api: bool = True,
                 flower: bool = False, echo: bool = False, console: Console | None = None,
                 extra_env: dict[str, str] | None = None, log_dir: Path | None = None, echo_level: int = logging.DEBUG,
                 restarts: bool = False, clock=time.monotonic):
        """``restarts``: ``tend`` (and ``wait_ready``) restart a child that exits on its own,
        by the settings' restart policy, as ``llmpipe up`` does; without it a child that
        exits stays down (the reliability tests restart what they kill themselves)."""
        self.s = settings
        self.kinds = kinds
        self.api = api
        self.flower = flower
        self.restarts = restarts
        self.console = console or Console(stderr=True, highlight=False)
        self.sup = Supervisor(log_dir or settings.state_dir / "logs", console=self.console, echo=echo,
                              echo_level=echo_level, clock=clock)
        # Every process writes its metrics here; the API's /metrics aggregates them.
        self.metrics_dir = Path(settings.state_dir) / "metrics" / str(settings.api_port)
        shutil.rmtree(self.metrics_dir, ignore_errors=True)
        self.metrics_dir.mkdir(parents=True, exist_ok=True)
        self.env = python_env({**settings_env(settings), "PROMETHEUS_MULTIPROC_DIR": str(self.metrics_dir),
                               **(extra_env or {})})
        # Off the CPUs vLLM computes on, once its engines are up (isolate_engine_cpus).
        self.placement = Placement() if settings.isolate_engine_cpus and placement_supported() else None
        self.sup.on_start = self._place_child

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.s.api_port}"

    def children_of(self, kind: str) -> list[tuple[str, str | None]]:
        """(child name, model) of each worker of ``kind``: ``inference_workers`` inference workers
        per served model (``inference``, or ``inference.<name>`` with several models,
        llmpipe/models/served.py; ``-1``, ``-2``, ... after it when a model has several), one
        of any other kind."""
        return inference_children(self.s) if kind == Stage.INFERENCE else [(kind, None)]

    def gpus(self) -> dict[str, str]:
        return worker_gpus(self.s)

    def start(self) -> LocalPipeline:
        gpus = self.gpus() if Stage.INFERENCE in self.kinds else {}
        for kind in self.kinds:
            for child, model in self.children_of(kind):
                env = {**self.env, KIND_ENV: kind, **({"CUDA_VISIBLE_DEVICES": gpus[child]} if child in gpus else {})}
                self.sup.spawn(child, worker_argv(kind, self.s, name=f"{child}-{self.s.api_port}@llmpipe", model=model),
                               env, self._policy())
        if self.api:
            self.sup.spawn("api", [sys.executable, "-m", "llmpipe.cli", "api", "--host", "127.0.0.1",
                                   "--port", str(self.s.api_port)], self.env, self._policy())
        if self.flower:
            self.sup.spawn(FLOWER, flower_argv(self.s), {**self.env, "FLOWER_UNAUTHENTICATED_API": "true"},
                           self._policy())
        return self

    def _policy(self) -> RestartPolicy | None:
        if not self.restarts:
            return None
        return RestartPolicy(self.s.restart_max_crashes, self.s.restart_window_s, clock=self.sup.clock)

    def first_exited(self) -> Child | None:
        dead = self.sup.exited()
        return dead[0] if dead else None

    def tend(self, now: float | None = None) -> list[Crash]:
        """One round of supervision (``restarts`` on): says on the console which child
        exited, how, and when it restarts. Raises PipelineError for a child that cannot
        start as configured (before the stack first served) and for one given up on."""
        for c in self.sup.exited():
            if c.restart_at is None and not c.ever_ready and c.proc.returncode in START_FAILURES:
                raise PipelineError(exit_reason(c))
        crashes = self.sup.tend(now)
        for crash in crashes:
            if crash.decision.give_up:
                raise PipelineError(crash_line(crash))
            self.console.print(f"llmpipe up: {crash_line(crash)}", style="yellow", markup=False, highlight=False)
        return crashes

    def wait_ready(self, timeout: float = 300.0, status=None, stop_event: threading.Event | None = None) -> bool:
        """Until every worker answers a ping and the API answers. Raises PipelineError when
        a child exits (with ``restarts``: when ``tend`` does) or at ``timeout``; returns
        False when ``stop_event`` is set."""
        probe = celery_probe(self.s.effective_broker_url, self.s.redis_url, self.s.redis_sentinel_master)
        want = {child for kind in self.kinds for child, _ in self.children_of(kind)}
        end = time.monotonic() + timeout
        api_ok = not self.api
        try:
            while time.monotonic() < end:
                if stop_event is not None and stop_event.is_set():
                    return False
                if self.restarts:
                    self.tend()
                else:
                    dead = self.first_exited()
                    if dead is not None:
                        raise PipelineError(exit_reason(dead))
                try:
                    replies = probe.control.ping(timeout=0.5) or []
                except Exception:  # Redis going away while we start: the child exits next
                    replies = []
                suffix = f"-{self.s.api_port}"
                seen = {name.split("@")[0].removesuffix(suffix) for r in replies for name in r}
                if not api_ok:
                    api_ok = self._api_answers()
                missing = sorted(want - seen) + ([] if api_ok else ["api"])
                if not missing:
                    for c in self.sup.children:
                        c.ever_ready = True
                    self._place()
                    return True
                if status is not None:
                    status.update(f"waiting for: {', '.join(missing)}")
                time.sleep(0.3)
        finally:
            probe.close()
        raise PipelineError(f"not ready after {timeout:.0f}s; see the logs in {self.sup.log_dir}")

    def _engine_children(self) -> set[str]:
        return {c for c, _ in inference_children(self.s)} if Stage.INFERENCE in self.kinds else set()

    def _place(self) -> None:
        """Every child onto the CPUs that the engines leave free, the engines' own processes
        excepted, and Flower onto the engines' CPUs below them (llmpipe/local/placement.py):
        nothing moves where the engines bind no CPU (a GPU)."""
        if self.placement is None:
            return
        engines = self._engine_children()
        workers = [c.proc.pid for c in self.sup.children if c.name in engines and c.running]
        cpus = self.placement.learn(workers)
        if cpus is None:
            return
        others = [c for c in self.sup.children if c.name not in engines and c.running]
        for c in others:
            self._place_other(c)
        for pid in workers:
            self.placement.apply_front_end(pid)
        log.info("%s and the inference workers' own processes run on CPUs %s, off the CPUs vLLM computes on",
                 ", ".join(c.name for c in others if c.name != FLOWER), ",".join(map(str, sorted(cpus))))

    def place(self, pid: int) -> None:
        """Another process of this host's pipeline (the embedded Redis) where the children are."""
        if self.placement is not None:
            self.placement.apply([pid])

    def _place_other(self, child: Child) -> None:
        if child.name == FLOWER:
            self.placement.apply_watcher(child.proc.pid)
        else:
            self.placement.apply([child.proc.pid])

    def _place_child(self, child: Child) -> None:
        # A child restarted after the engines came up goes where its kind went at once; a
        # restarted inference worker once its new engine has bound its CPUs.
        if self.placement is None:
            return
        if child.name not in self._engine_children():
            self._place_other(child)
        elif self.placement.cpus is not None:
            pid = child.proc.pid
            threading.Thread(target=self.placement.follow_front_end, name=f"place-{child.name}", daemon=True,
                             args=(pid, lambda: child.running and child.proc.pid == pid),
                             kwargs={"timeout_s": ENGINE_BIND_TIMEOUT_S}).start()

    def _api_answers(self) -> bool:
        """The API serves and reaches Redis: /healthz answers 200, or 503 for a stage with
        no live worker yet (the workers are waited for by their pings)."""
        try:
            r = httpx.get(f"{self.api_url}/healthz", timeout=1)
            return r.status_code == 200 or (r.status_code == 503 and "stages" in r.json().get("error", {}))
        except (httpx.HTTPError, ValueError, AttributeError):
            return False

    def stop(self, timeout: float = 60.0, force_event: threading.Event | None = None) -> bool:
        """Warm, in pipeline order: each stage finishes what it runs before the next one
        stops, so running requests get through; the API and Flower stop last."""
        return self.sup.stop(timeout=timeout, force_event=force_event,
                             order=[[c for c, _ in self.children_of(k)] for k in WORKER_KINDS])

    def __enter__(self) -> LocalPipeline:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
