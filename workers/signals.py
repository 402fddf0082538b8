"""Worker lifecycle hooks: warm the engine at start, release it on shutdown."""

from __future__ import annotations

import logging
import os
import sys

from celery.signals import worker_process_shutdown, worker_ready, worker_shutdown

from workers.context import context

log = logging.getLogger("llmpipe.worker")


@worker_ready.connect
def _warm(sender=None, **_):
    # The inference worker loads its engine before taking traffic, so the first request
    # does not pay the load; other kinds load their tokenizer lazily.
    if os.environ.get("LLMPIPE_WORKER_KIND") == "inference":
        s = context().settings
        log.info("loading engine %s for model %s", s.engine.value, s.model)
        try:
            context().inference()
        except Exception as exc:  # a worker without an engine must not take traffic
            log.critical("engine %s could not start: %s: %s", s.engine.value, type(exc).__name__, exc)
            print(f"llmpipe: engine {s.engine.value} could not start: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            os._exit(3)
        log.info("engine ready")


@worker_shutdown.connect
@worker_process_shutdown.connect
def _shutdown(**_):
    context().shutdown_all()
