"""``llmpipe up``: everything in one command, with a warm shutdown on Ctrl-C."""

from __future__ import annotations

import secrets
import signal
import threading

from rich.console import Console

from llmpipe.local import LocalPipeline, PipelineError
from llmpipe.redis_server import EmbeddedRedis, port_in_use, redis_answers
from llmpipe.settings import Settings


def run_up(s: Settings, *, flower: bool = True, echo: bool = True, redis_explicit: bool = False,
           ready_timeout: float = 600.0) -> int:
    from llmpipe.models.registry import resolve_model

    console = Console(stderr=True, highlight=False)
    embedded: EmbeddedRedis | None = None
    pipeline: LocalPipeline | None = None
    force = threading.Event()
    stopping = threading.Event()

    def on_signal(signum, frame):
        if stopping.is_set():
            console.print("[red]forcing shutdown[/]")
            force.set()
        else:
            stopping.set()

    try:
        for port, what in [(s.api_port, "API"), *([(s.flower_port, "Flower")] if flower else [])]:
            if port_in_use(port):
                raise PipelineError(f"port {port} for the {what} is already in use (choose another with --port/--flower-port)")
        if s.redis_url != "embedded" and redis_answers(s.redis_url):
            console.print(f"redis: using {s.redis_url}")
        elif redis_explicit and s.redis_url != "embedded":
            raise PipelineError(f"redis at {s.redis_url} does not answer")
        else:
            embedded = EmbeddedRedis(s.state_dir / "redis").start()
            s = s.model_copy(update={"redis_url": embedded.url})
            console.print(f"redis: {s.redis_url} did not answer; started an embedded redis-server at {embedded.url} "
                          f"(AOF in {embedded.data_dir})")
        try:
            model_path = resolve_model(s.model, s.models_dir, progress=True)
        except Exception as exc:
            raise PipelineError(f"model {s.model!r}: {exc}") from exc
        console.print(f"model: {s.model} -> {model_path}; engine: {s.engine.value}")
        if flower and not s.flower_password:
            s = s.model_copy(update={"flower_password": secrets.token_urlsafe(12)})
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        pipeline = LocalPipeline(s, flower=flower, echo=echo, console=console).start()
        with console.status("starting") as status:
            pipeline.wait_ready(ready_timeout, status=status)
        _print_ready(console, s, flower)
        while not stopping.is_set():
            dead = pipeline.first_exited()
            if dead is not None:
                raise PipelineError(f"{dead.name} exited with code {dead.proc.returncode} (log: {dead.log_path})")
            stopping.wait(0.5)
        console.print("[yellow]warm shutdown: running requests finish, queued jobs stay in Redis (Ctrl-C again to force)[/]")
        return 0
    except PipelineError as exc:
        console.print(f"[red]llmpipe up: {exc}[/]")
        return 2
    finally:
        stopping.set()
        if pipeline is not None:
            pipeline.stop(timeout=90.0, force_event=force)
        if embedded is not None:
            embedded.stop()
        console.print("stopped")


def _print_ready(console: Console, s: Settings, flower: bool) -> None:
    api = f"http://127.0.0.1:{s.api_port}"
    lines = ["[bold green]llmpipe is ready[/]", f"  API      {api}   (docs: {api}/docs)"]
    if flower:
        lines.append(f"  Flower   http://127.0.0.1:{s.flower_port}   (user {s.flower_user}, password {s.flower_password})")
    lines += [
        "  try:",
        f"    curl -s -X POST {api}/v1/jobs -H 'content-type: application/json' \\",
        "      -d '{\"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], \"max_tokens\": 32, \"temperature\": 0}'",
        f"    curl -s {api}/v1/jobs/<id>",
        "    .venv/bin/llmpipe chat \"What is the capital of France?\"",
    ]
    console.print("\n".join(lines), markup=True)
