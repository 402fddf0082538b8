"""The workers' consumer (celeryconfig ``worker_consumer``): Celery's, but back within a
second of a broker that went away and came back.

Celery's consumer reconnects with kombu's defaults: it waits 2 s after the first failed
attempt, 4 s after the second, 6 s after the third, up to 30 s. After a Redis restart the
workers therefore came back only at their next attempt, up to an attempt's wait after Redis
did, and a job submitted meanwhile sat in the preprocess queue (measured here, the
transformers engine on the tiny model: 5.3 s after a 7 s restart, 7.2 s after a 13 s one;
the waits grow to 30 s). Here each worker tries again
every ``RECONNECT_MAX_S`` at most, for as long as the broker is away (one connection
attempt a second per worker costs the broker nothing), and says so in one line every
``LOG_EVERY_S`` instead of one line per attempt.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

from celery.worker.consumer import Consumer as CeleryConsumer

RECONNECT_MAX_S = 1.0
# kombu's retry_over_time: sleep interval_start, then interval_step more each time, at most interval_max
RECONNECT = {"interval_start": 0.2, "interval_step": 0.4, "interval_max": RECONNECT_MAX_S}
LOG_EVERY_S = 10.0


def every_so_often(errback: Callable[[Any, float], Any] | None, every_s: float = LOG_EVERY_S,
                   clock: Callable[[], float] = time.monotonic) -> Callable[[Any, float], Any] | None:
    """``errback`` (Celery's "Cannot connect ... Trying again" line) for the first failure,
    then at most once every ``every_s``."""
    if errback is None:
        return None
    last: list[float] = []

    def quieter(exc: Any, interval: float) -> Any:
        now = clock()
        if not last or now - last[0] >= every_s:
            last[:] = [now]
            return errback(exc, interval)
        return None

    return quieter


@contextmanager
def reconnecting(conn: Any):
    """While it lasts, ``conn.ensure_connection`` (as Celery's consumer calls it) retries for
    as long as the broker is away, ``RECONNECT`` apart, saying so every ``LOG_EVERY_S``."""
    original = conn.ensure_connection

    def ensure(errback=None, max_retries=None, **kwargs):
        # for as long as it takes: a worker without its broker can do nothing else
        return original(every_so_often(errback), None, **{**kwargs, **RECONNECT})

    conn.ensure_connection = ensure  # this call's only: the connection's own method stays
    try:
        yield conn
    finally:
        del conn.ensure_connection


class Consumer(CeleryConsumer):
    def ensure_connected(self, conn):
        with reconnecting(conn):
            return super().ensure_connected(conn)
