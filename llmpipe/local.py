"""A whole pipeline as local child processes: one worker per kind, the API, Flower.

Used by ``llmpipe up``, the benchmark and the integration tests, so all three run the
same real processes.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
from rich.console import Console

from llmpipe.settings import Settings
from llmpipe.supervisor import Child, Supervisor, python_env

WORKER_KINDS = ("preprocess", "inference", "postprocess")


class PipelineError(Exception):
    """A clear, one-line reason why the pipeline cannot serve."""


_CELERY_PREFIX = re.compile(r"^\[\d{4}-\d\d-\d\d [^\]]*\]\s*")


def exit_reason(child: Child) -> str:
    """One line on why a child exited: its own ``llmpipe:`` line if it printed one (an
    engine that cannot start), else its last line of output."""
    lines = [_CELERY_PREFIX.sub("", ln.strip()) for ln in child.tail if ln.strip()]
    own = [ln for ln in lines if ln.startswith("llmpipe:")]
    last = own[-1].removeprefix("llmpipe:").strip() if own else (lines[-1] if lines else "")
    code = child.proc.returncode if child.proc else None
    how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exited with code {code}"
    return f"{child.name} {how}" + (f": {last[:300]}" if last else "") + f" (log: {child.log_path})"


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


class LocalPipeline:
    def __init__(self, settings: Settings, *, kinds: tuple[str, ...] = WORKER_KINDS, api: bool = True,
                 flower: bool = False, echo: bool = False, console: Console | None = None,
                 extra_env: dict[str, str] | None = None, log_dir: Path | None = None, echo_level: int = logging.DEBUG):
        self.s = settings
        self.kinds = kinds
        self.api = api
        self.flower = flower
        self.console = console or Console(stderr=True, highlight=False)
        self.sup = Supervisor(log_dir or settings.state_dir / "logs", console=self.console, echo=echo,
                              echo_level=echo_level)
        # Every process writes its metrics here; the API's /metrics aggregates them.
        self.metrics_dir = Path(settings.state_dir) / "metrics" / str(settings.api_port)
        shutil.rmtree(self.metrics_dir, ignore_errors=True)
        self.metrics_dir.mkdir(parents=True, exist_ok=True)
        self.env = python_env({**settings_env(settings), "PROMETHEUS_MULTIPROC_DIR": str(self.metrics_dir),
                               **(extra_env or {})})

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.s.api_port}"

    def start(self) -> LocalPipeline:
        from workers.launch import worker_argv

        for kind in self.kinds:
            self.sup.spawn(kind, worker_argv(kind, self.s, name=f"{kind}-{self.s.api_port}@llmpipe"),
                           {**self.env, "LLMPIPE_WORKER_KIND": kind})
        if self.api:
            self.sup.spawn("api", [sys.executable, "-m", "llmpipe.cli", "api", "--host", "127.0.0.1",
                                   "--port", str(self.s.api_port)], self.env)
        if self.flower:
            self.sup.spawn("flower", flower_argv(self.s), {**self.env, "FLOWER_UNAUTHENTICATED_API": "true"})
        return self

    def first_exited(self) -> Child | None:
        dead = self.sup.exited()
        return dead[0] if dead else None

    def wait_ready(self, timeout: float = 300.0, status=None, stop_event: threading.Event | None = None) -> bool:
        """Until every worker answers a ping and the API is healthy. Raises PipelineError
        when a child exits or at ``timeout``; returns False when ``stop_event`` is set."""
        from celery import Celery

        probe = Celery(broker=self.s.redis_url, backend=self.s.redis_url)
        want = set(self.kinds)
        end = time.monotonic() + timeout
        api_ok = not self.api
        try:
            while time.monotonic() < end:
                if stop_event is not None and stop_event.is_set():
                    return False
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
                    try:
                        api_ok = httpx.get(f"{self.api_url}/healthz", timeout=1).status_code == 200
                    except httpx.HTTPError:
                        api_ok = False
                missing = sorted(want - seen) + ([] if api_ok else ["api"])
                if not missing:
                    return True
                if status is not None:
                    status.update(f"waiting for: {', '.join(missing)}")
                time.sleep(0.3)
        finally:
            probe.close()
        raise PipelineError(f"not ready after {timeout:.0f}s; see the logs in {self.sup.log_dir}")

    def stop(self, timeout: float = 60.0, force_event: threading.Event | None = None) -> bool:
        """Warm, in pipeline order: each stage finishes what it runs before the next one
        stops, so running requests get through; the API and Flower stop last."""
        return self.sup.stop(timeout=timeout, force_event=force_event, order=[[k] for k in WORKER_KINDS])

    def __enter__(self) -> LocalPipeline:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
