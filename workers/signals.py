"""Worker lifecycle hooks: warm the engine (or the tokenizer) at start, release it on
shutdown. A worker that cannot warm prints one ``llmpipe:`` line and exits with code 3,
which ``llmpipe up`` reports as the reason it cannot serve."""

from __future__ import annotations

import logging
import os
import sys

from celery.signals import worker_init, worker_process_shutdown, worker_ready, worker_shutdown

from workers.context import context

log = logging.getLogger("llmpipe.worker")

EXIT_CANNOT_WARM = 3


def one_line(exc: BaseException, limit: int = 400) -> str:
    """``Type: message`` on one line, at most ``limit`` chars."""
    text = " ".join(str(exc).split())
    line = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _cannot_warm(what: str, exc: BaseException) -> None:
    line = f"llmpipe: {what} could not start: {one_line(exc)}"
    log.critical("%s", line.removeprefix("llmpipe: "), exc_info=True)
    # The real stderr: Celery redirects sys.stderr into its logger.
    print(line, file=sys.__stderr__, flush=True)
    os._exit(EXIT_CANNOT_WARM)


@worker_init.connect
def _warm_cpu_stage(sender=None, **_):
    # The CPU stages load the tokenizer in the main process before their prefork pool
    # forks, so no pool process pays the load on its first request (seconds on a small
    # machine) and a model without a usable tokenizer stops the worker at once.
    if os.environ.get("LLMPIPE_WORKER_KIND") in ("preprocess", "postprocess"):
        try:
            ctx = context()
            ctx.tokenizer_owner.get()
            ctx.context_len  # noqa: B018 - reads config.json once
        except Exception as exc:  # a worker that cannot tokenize must not take traffic
            _cannot_warm(f"tokenizer for model {context().settings.model}", exc)


@worker_ready.connect
def _warm(sender=None, **_):
    # The inference worker loads its engine before taking traffic, so the first request
    # does not pay the load (and it answers pings only once the engine is up).
    if os.environ.get("LLMPIPE_WORKER_KIND") == "inference":
        s = context().settings
        log.info("loading engine %s for model %s", s.engine.value, s.model)
        try:
            context().inference()
        except Exception as exc:  # a worker without an engine must not take traffic
            _cannot_warm(f"engine {s.engine.value}", exc)
        log.info("engine ready")


@worker_shutdown.connect
@worker_process_shutdown.connect
def _shutdown(**_):
    context().shutdown_all()
