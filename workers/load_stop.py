"""Stopping an inference worker whose engine is still loading.

Such a worker holds no request: it runs none before its engine is up, and what its
consumer may have fetched goes back to the broker when its connection closes. A warm
shutdown has nothing to wait for, so the worker exits at once, from Celery's signal
handler, with code 0, and takes down the processes its load started (vLLM's engine core,
which stops its own workers).

It exits there instead of raising WorkerShutdown into the load. Python runs a signal
handler on whatever bytecode the main thread is at, and an exception raised there lands in
the load's own code. Both of these were seen with the tiny model: a finalizer
(``__del__``) swallowed it and the load ran its whole minute; an import interrupted
halfway made the next one fail (a RecursionError in numpy), which read as an engine that
cannot start.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import time
from collections.abc import Callable

from celery.platforms import EX_OK

log = logging.getLogger("llmpipe.worker")

GRACE_S = 5.0  # vLLM's engine core tears down in a few seconds on SIGTERM


def stop_children(grace_s: float = GRACE_S, *, clock: Callable[[], float] = time.monotonic) -> list[int]:
    """SIGTERM this process's multiprocessing children, SIGKILL those still running after
    ``grace_s``; returns their pids. Other processes (multiprocessing's resource tracker)
    are left to exit with this one."""
    procs = multiprocessing.active_children()
    for p in procs:
        p.terminate()
    end = clock() + grace_s
    for p in procs:
        p.join(max(0.0, end - clock()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(grace_s)
    return [p.pid for p in procs]


def stop_loading_worker(heart=None, exit_: Callable[[int], object] = os._exit) -> None:
    """Say the worker is offline (Celery's ``heart``, when events are on), stop the
    processes the load started, and exit with code 0."""
    if heart is not None:
        try:
            heart.stop()  # sends worker-offline, so Flower does not wait for the heartbeat to lapse
        except Exception as exc:  # the broker may be what is going away
            log.warning("could not send worker-offline: %r", exc)
    _flush()
    # What the process logs from here on is the load's own client finding its engine core
    # gone (vLLM logs that as a failure, with a traceback): it is the stop, not news.
    logging.disable(logging.CRITICAL)
    stop_children()
    _flush()
    exit_(EX_OK)


def _flush() -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        if stream is not None:
            stream.flush()
