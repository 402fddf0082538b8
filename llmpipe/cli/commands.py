"""The ``llmpipe`` command."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click
from pydantic import ValidationError

from llmpipe.cli.batch import batch
from llmpipe.cli.client import cancel, chat, submit
from llmpipe.engines.platform import describe_config
from llmpipe.engines.vllm_args import EngineArgError, parse_pairs
from llmpipe.errors import ModelNotFoundError
from llmpipe.jobs.deadletter import main as deadletter_main
from llmpipe.local import up as local_up
from llmpipe.local.pipeline import flower_argv
from llmpipe.models.registry import resolve_model
from llmpipe.models.smollm2 import prepare_smollm2
from llmpipe.models.tiny import build_tiny
from llmpipe.parsing.config import STRICT_LEVELS
from llmpipe.settings import ConfigFileError, EngineKind, Settings
from llmpipe.stages import STAGE_QUEUES
from workers.launch import KIND_ENV, celery_command, worker_argv


def _overrides(**kw) -> dict:
    return {k: v for k, v in kw.items() if v is not None}


@click.group()
def main() -> None:
    """llmpipe: LLM serving on a Celery pipeline."""


def load_settings(**overrides) -> Settings:
    """Settings from flags (``overrides``), the environment and the config file, or a
    one-line error."""
    try:
        return Settings(**_overrides(**overrides))
    except ConfigFileError as exc:
        raise click.ClickException(str(exc)) from None
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()))
        if not where:  # a check across settings: its message says it all
            raise click.ClickException(f"invalid settings: {err.get('msg', '').removeprefix('Value error, ')}") from None
        raise click.ClickException(f"invalid setting {where}={err.get('input')!r}: {err.get('msg')}") from None


@main.command()
@click.option("--model", multiple=True, metavar="[NAME=]MODEL",
              help="smollm2 (default), tiny, a local model folder, or a hub id. Repeat it to serve several "
                   "models, each with its own inference worker and queue inference.<name>.")
@click.option("--engine", type=click.Choice([e.value for e in EngineKind]), help="Inference engine.")
@click.option("--redis-url", help="Use this Redis (it must answer), or 'embedded' for a Redis of llmpipe's own. "
              "Default: the configured one when it answers, else an embedded one.")
@click.option("--cpu-workers", type=int, help="Processes in each of the preprocess and postprocess pools.")
@click.option("--batch-window-ms", type=float, help="Longest wait for a batch to fill, from its first request.")
@click.option("--max-batch-size", type=int)
@click.option("--port", type=int, help="API port (default 8000).")
@click.option("--flower-port", type=int, help="Flower port (default 5555).")
@click.option("--no-flower", is_flag=True)
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False),
              help="A TOML or JSON settings file (same as LLMPIPE_CONFIG); flags and LLMPIPE_* win over it.")
@click.option("--state-dir", type=click.Path(file_okay=False), help="Models, logs and the embedded Redis live here.")
@click.option("--ready-timeout", type=float, default=600.0, show_default=True, help="Seconds to wait for readiness.")
@click.option("--quiet", is_flag=True, help="Do not echo the children's logs (they still go to the log files).")
@click.option("--verbose", is_flag=True, help="Echo every line of the children's logs, not only warnings and errors.")
@click.option("--engine-arg", "engine_args", multiple=True, metavar="KEY=VALUE",
              help="A vLLM engine argument (AsyncEngineArgs field), e.g. tensor_parallel_size=2; repeatable. "
                   "Wins over the config file's [engine_args] table.")
@click.option("--print-config", is_flag=True, help="Print the effective settings, the engine arguments and the "
              "platform that chose their defaults, then exit.")
@click.option("--inference-workers", "inference_workers", multiple=True, metavar="N|NAME=N",
              help="Inference workers per served model (default 1): N for every model, or NAME=N for one "
                   "(repeatable). On CUDA each gets GPUs of its own (tensor_parallel_size each); requests go "
                   "to the worker that caches their prompt's prefix (prefix_routing).")
@click.option("--enable-auto-tool-choice", "enable_auto_tool_choice", is_flag=True, default=None,
              help="As vllm serve's: tool_choice auto for the models' tool parser (needs --tool-call-parser).")
@click.option("--tool-call-parser", help="vLLM's tool-call parser for every served model (hermes, llama3_json, ...).")
@click.option("--reasoning-parser", help="vLLM's reasoning parser for every served model (qwen3, deepseek_r1, ...).")
@click.option("--tool-strict-level", type=click.Choice(STRICT_LEVELS),
              help="As vllm serve's: how far a forced tool call is pinned (parameter: every tool's arguments "
                   "decode to its schema).")
@click.option("--trust-request-chat-template", "trust_request_chat_template", is_flag=True, default=None,
              help="As vllm serve's: a request may bring its own chat_template.")
def up(model, engine, redis_url, cpu_workers, batch_window_ms, max_batch_size, port, flower_port, no_flower,
       config_file, state_dir, ready_timeout, quiet, verbose, engine_args, print_config, inference_workers,
       **parsers):
    """Start Redis (if needed), the workers, the API and Flower; Ctrl-C stops them."""
    if config_file:
        os.environ["LLMPIPE_CONFIG"] = os.path.abspath(config_file)
    try:
        passed = parse_pairs(engine_args) or None
    except EngineArgError as exc:
        raise click.ClickException(str(exc)) from None
    s = load_settings(**_model_overrides(model), engine=engine, redis_url=redis_url, cpu_workers=cpu_workers,
                      batch_window_ms=batch_window_ms, max_batch_size=max_batch_size, api_port=port,
                      flower_port=flower_port, state_dir=state_dir, engine_args=passed,
                      inference_workers=_workers_override(inference_workers), **parsers)
    if print_config:
        try:
            click.echo(describe_config(s))
        except EngineArgError as exc:
            raise click.ClickException(str(exc)) from None
        return
    sys.exit(local_up.run_up(s, flower=not no_flower, echo=not quiet, redis_explicit="redis_url" in s.model_fields_set,
                    ready_timeout=ready_timeout, verbose=verbose))


def _workers_override(given: tuple[str, ...]) -> str | None:
    """``--inference-workers``: ``2``, or ``tiny=2`` (repeated for several models), as the
    setting reads it; not given: None (the config file's, or 1)."""
    if not given:
        return None
    if len(given) == 1 and "=" not in given[0]:
        return given[0]
    if any("=" not in g for g in given):
        raise click.ClickException("--inference-workers takes one N for every model, or NAME=N per model")
    return ",".join(given)


def _model_overrides(specs: tuple[str, ...]) -> dict:
    """``--model`` given: the served list (llmpipe/models/served.py); not given: nothing."""
    if not specs:
        return {}
    return {"models": list(specs)}


@main.command()
@click.argument("kind", type=click.Choice(list(STAGE_QUEUES)))
@click.option("--model", help="inference only: the served model (by name) whose queue it serves; default the first.")
@click.option("--concurrency", "-c", type=int)
@click.option("--name", "-n", help="Worker node name (default KIND@hostname).")
@click.option("--loglevel", "-l", default="INFO")
@click.option("--print", "print_only", is_flag=True, help="Print the celery command line instead of running it.")
def worker(kind, model, concurrency, name, loglevel, print_only):
    """Run one Celery worker for one queue (the celery command line of README.md)."""
    s = load_settings()
    try:
        if print_only:
            click.echo(celery_command(kind, s, concurrency=concurrency, name=name, loglevel=loglevel, model=model))
            return
        argv = worker_argv(kind, s, concurrency=concurrency, name=name, loglevel=loglevel, model=model)
    except ModelNotFoundError as exc:
        raise click.ClickException(exc.message) from None
    os.environ[KIND_ENV] = kind
    os.execv(argv[0], argv)


@main.command()
@click.option("--host", default="127.0.0.1")
@click.option("--port", type=int)
@click.option("--workers", type=int, default=1)
def api(host, port, workers):
    """Run the HTTP API (uvicorn)."""
    import uvicorn

    s = load_settings()
    uvicorn.run("api.app:serve_app", factory=True, host=host, port=port or s.api_port, workers=workers,
                log_level="info", timeout_graceful_shutdown=10)


@main.command()
@click.option("--port", type=int)
@click.option("--address", default="127.0.0.1")
def flower(port, address):
    """Run Flower with basic auth (LLMPIPE_FLOWER_USER / LLMPIPE_FLOWER_PASSWORD)."""
    s = load_settings()
    if not s.flower_password and address not in ("127.0.0.1", "localhost", "::1"):
        raise click.ClickException(f"set LLMPIPE_FLOWER_PASSWORD to serve Flower on {address} (basic auth)")
    argv = flower_argv(s, port=port, address=address)
    os.execv(argv[0], argv)


@main.command()
@click.argument("names", nargs=-1, required=True, type=click.Choice(["tiny", "smollm2"]))
@click.option("--dest", type=click.Path(), help="Output folder (default: the state dir's models/); one model only.")
def model(names, dest):
    """Prepare models offline: the tiny test Llama and/or SmolLM2-135M-Instruct (each once)."""
    s = load_settings()
    if dest and len(names) > 1:
        raise click.ClickException("--dest takes one model")
    for name in dict.fromkeys(names):
        if dest:
            path = (build_tiny if name == "tiny" else prepare_smollm2)(Path(dest))
        else:
            path = resolve_model(name, s.models_dir, progress=True)
        click.echo(str(path))


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.pass_context
def deadletter(ctx):
    """List (or --purge) dead-lettered requests: [--json] [--limit N] [--purge] [--redis-url URL]."""
    sys.exit(deadletter_main(ctx.args))


main.add_command(submit)
main.add_command(chat)
main.add_command(cancel)
main.add_command(batch)

try:  # the benchmark brings its own heavier imports
    from llmpipe.bench.cli import bench  # noqa: E402

    main.add_command(bench)
except ImportError:  # pragma: no cover
    pass


if __name__ == "__main__":
    main()
