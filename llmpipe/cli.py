"""The ``llmpipe`` command."""

from __future__ import annotations

import os
import sys

import click

from llmpipe.settings import EngineKind, Settings


def _overrides(**kw) -> dict:
    return {k: v for k, v in kw.items() if v is not None}


@click.group()
def main() -> None:
    """llmpipe: LLM serving on a Celery pipeline."""


@main.command()
@click.option("--model", help="smollm2 (default), tiny, a local model folder, or a hub id.")
@click.option("--engine", type=click.Choice([e.value for e in EngineKind]), help="Inference engine.")
@click.option("--redis-url", help="Use this Redis; without one that answers, an embedded Redis starts.")
@click.option("--cpu-workers", type=int, help="Processes in each of the preprocess and postprocess pools.")
@click.option("--batch-window-ms", type=float, help="Longest wait for a batch to fill, from its first request.")
@click.option("--max-batch-size", type=int)
@click.option("--port", type=int, help="API port (default 8000).")
@click.option("--flower-port", type=int)
@click.option("--no-flower", is_flag=True)
@click.option("--quiet", is_flag=True, help="Do not echo the children's logs.")
def up(model, engine, redis_url, cpu_workers, batch_window_ms, max_batch_size, port, flower_port, no_flower, quiet):
    """Start Redis (if needed), the workers, the API and Flower; Ctrl-C stops them."""
    from llmpipe.up import run_up

    s = Settings(**_overrides(model=model, engine=engine, redis_url=redis_url, cpu_workers=cpu_workers,
                              batch_window_ms=batch_window_ms, max_batch_size=max_batch_size, api_port=port,
                              flower_port=flower_port))
    sys.exit(run_up(s, flower=not no_flower, echo=not quiet, redis_explicit=redis_url is not None or "LLMPIPE_REDIS_URL" in os.environ))


@main.command()
@click.argument("kind", type=click.Choice(["preprocess", "inference", "postprocess", "collect"]))
@click.option("--concurrency", "-c", type=int)
@click.option("--name", "-n", help="Worker node name (default KIND@hostname).")
@click.option("--loglevel", "-l", default="INFO")
def worker(kind, concurrency, name, loglevel):
    """Run one Celery worker for one queue."""
    from workers.launch import worker_argv

    argv = worker_argv(kind, Settings(), concurrency=concurrency, name=name, loglevel=loglevel)
    os.environ["LLMPIPE_WORKER_KIND"] = kind
    os.execv(argv[0], argv)


@main.command()
@click.option("--host", default="127.0.0.1")
@click.option("--port", type=int)
@click.option("--workers", type=int, default=1)
def api(host, port, workers):
    """Run the HTTP API (uvicorn)."""
    import uvicorn

    s = Settings()
    uvicorn.run("api.app:create_app", factory=True, host=host, port=port or s.api_port, workers=workers,
                log_level="info", timeout_graceful_shutdown=10)


@main.command()
@click.option("--port", type=int)
@click.option("--address", default="127.0.0.1")
def flower(port, address):
    """Run Flower with basic auth (LLMPIPE_FLOWER_USER / LLMPIPE_FLOWER_PASSWORD)."""
    from llmpipe.local import flower_argv

    argv = flower_argv(Settings(), port=port, address=address)
    os.execv(argv[0], argv)


@main.command()
@click.argument("name", type=click.Choice(["tiny", "smollm2"]))
@click.option("--dest", type=click.Path(), help="Output folder (default: the state dir's models/).")
def model(name, dest):
    """Prepare a model offline: the tiny test Llama or SmolLM2-135M-Instruct."""
    from pathlib import Path

    from llmpipe.models.registry import resolve_model

    s = Settings()
    if dest:
        from llmpipe.models.smollm2 import prepare_smollm2
        from llmpipe.models.tiny import build_tiny

        path = (build_tiny if name == "tiny" else prepare_smollm2)(Path(dest))
    else:
        path = resolve_model(name, s.models_dir, progress=True)
    click.echo(str(path))


from llmpipe.client_cli import chat, submit  # noqa: E402

main.add_command(submit)
main.add_command(chat)

try:  # the benchmark brings its own heavier imports
    from llmpipe.bench.cli import bench  # noqa: E402

    main.add_command(bench)
except ImportError:  # pragma: no cover
    pass


if __name__ == "__main__":
    main()
