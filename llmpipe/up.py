"""``llmpipe up``: everything in one command, with a warm shutdown on Ctrl-C."""

from __future__ import annotations

import secrets
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
from rich.console import Console

from llmpipe.redis_server import EmbeddedRedis, port_in_use, redis_answers
from llmpipe.settings import Settings
from llmpipe.supervisor import Supervisor, python_env

WORKER_KINDS = ("preprocess", "inference", "postprocess")


class UpError(Exception):
    """A clear, one-line reason why `llmpipe up` cannot serve."""


def flower_argv(s: Settings, *, port: int | None = None, address: str = "127.0.0.1") -> list[str]:
    argv = [sys.executable, "-m", "celery", "-A", "tasks", "flower", f"--port={port or s.flower_port}",
            f"--address={address}", "--purge_offline_workers=60"]
    if s.flower_password:
        argv.append(f"--basic-auth={s.flower_user}:{s.flower_password}")
    return argv


def _wait_ready(s: Settings, sup: Supervisor, console: Console, timeout: float) -> None:
    from llmpipe.celery_app import app as celery

    celery.conf.broker_url = s.redis_url
    celery.conf.result_backend = s.redis_url
    want = set(WORKER_KINDS)
    end = time.monotonic() + timeout
    api_ok = False
    with console.status("waiting for the workers and the API...") as status:
        while time.monotonic() < end:
            dead = sup.exited()
            if dead:
                c = dead[0]
                last = next((ln for ln in reversed(c.tail) if ln.strip()), "")
                raise UpError(f"{c.name} exited with code {c.proc.returncode}: {last.strip()[:300]} (log: {c.log_path})")
            replies = celery.control.ping(timeout=1.0) or []
            seen = {name.split("@")[0] for r in replies for name in r}
            if not api_ok:
                try:
                    api_ok = httpx.get(f"http://127.0.0.1:{s.api_port}/healthz", timeout=1).status_code == 200
                except httpx.HTTPError:
                    api_ok = False
            missing = sorted(want - seen) + ([] if api_ok else ["api"])
            if not missing:
                return
            status.update(f"waiting for: {', '.join(missing)}")
            time.sleep(0.5)
    raise UpError(f"not ready after {timeout:.0f}s; see the logs in {sup.log_dir}")


def run_up(s: Settings, *, flower: bool = True, echo: bool = True, redis_explicit: bool = False,
           ready_timeout: float = 600.0) -> int:
    from llmpipe.cli import settings_env
    from llmpipe.models.registry import resolve_model

    console = Console(stderr=True, highlight=False)
    embedded: EmbeddedRedis | None = None
    sup = Supervisor(s.state_dir / "logs", console=console, echo=echo)
    force = threading.Event()
    stopping = threading.Event()

    def on_sigint(signum, frame):
        if stopping.is_set():
            console.print("[red]forcing shutdown[/]")
            force.set()
        else:
            stopping.set()

    try:
        for port, what in [(s.api_port, "API"), *([(s.flower_port, "Flower")] if flower else [])]:
            if port_in_use(port):
                raise UpError(f"port {port} for the {what} is already in use (choose another with --port/--flower-port)")
        if redis_answers(s.redis_url):
            console.print(f"redis: using {s.redis_url}")
        elif redis_explicit:
            raise UpError(f"redis at {s.redis_url} does not answer")
        else:
            embedded = EmbeddedRedis(s.state_dir / "redis").start()
            s = s.model_copy(update={"redis_url": embedded.url})
            console.print(f"redis: started embedded redis-server at {embedded.url} (AOF in {embedded.data_dir})")
        try:
            model_path = resolve_model(s.model, s.models_dir, progress=True)
        except Exception as exc:
            raise UpError(f"model {s.model!r}: {exc}") from exc
        if Path(model_path).exists():
            console.print(f"model: {s.model} at {model_path}")
        if flower and not s.flower_password:
            s = s.model_copy(update={"flower_password": secrets.token_urlsafe(12)})
        base_env = python_env(settings_env(s))
        from workers.launch import worker_argv

        for kind in WORKER_KINDS:
            sup.spawn(kind, worker_argv(kind, s, name=f"{kind}@llmpipe"), {**base_env, "LLMPIPE_WORKER_KIND": kind})
        sup.spawn("api", [sys.executable, "-m", "llmpipe.cli", "api", "--host", "127.0.0.1", "--port", str(s.api_port)], base_env)
        if flower:
            sup.spawn("flower", flower_argv(s), base_env)
        signal.signal(signal.SIGINT, on_sigint)
        signal.signal(signal.SIGTERM, on_sigint)
        _wait_ready(s, sup, console, ready_timeout)
        _print_ready(console, s, flower)
        while not stopping.is_set():
            dead = sup.exited()
            if dead:
                c = dead[0]
                raise UpError(f"{c.name} exited with code {c.proc.returncode} (log: {c.log_path})")
            stopping.wait(0.5)
        console.print("[yellow]warm shutdown: running requests finish, queued jobs stay in Redis (Ctrl-C again to force)[/]")
        return 0
    except UpError as exc:
        console.print(f"[red]llmpipe up: {exc}[/]")
        return 2
    finally:
        stopping.set()
        sup.stop(timeout=90.0, force_event=force)
        if embedded is not None:
            embedded.stop()
        console.print("stopped")


def _print_ready(console: Console, s: Settings, flower: bool) -> None:
    api = f"http://127.0.0.1:{s.api_port}"
    lines = [
        "[bold green]llmpipe is ready[/]",
        f"  API      {api}   (docs: {api}/docs)",
    ]
    if flower:
        lines.append(f"  Flower   http://127.0.0.1:{s.flower_port}   (user {s.flower_user}, password {s.flower_password})")
    lines += [
        "  try:",
        f"    curl -s -X POST {api}/v1/jobs -H 'content-type: application/json' \\",
        "      -d '{\"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], \"max_tokens\": 32, \"temperature\": 0}'",
        f"    curl -s {api}/v1/jobs/<id>",
        "    llmpipe chat \"What is the capital of France?\"",
    ]
    console.print("\n".join(lines))
