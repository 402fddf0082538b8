"""A Celery app on llmpipe's celeryconfig (so on the lease transport) with one task that
only holds its message for a while: worker kills and stalls without a model.

Run as ``celery -A tests.integration.lease_app worker -Q leasetest``. The task counts its
starts and ends per key in Redis, and stores its result once per key (HSETNX, as StageMemo
does for the real stages), so a test sees every run and every result write."""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

app = Celery("leasetest")
app.config_from_object("celeryconfig")
app.conf.imports = ()  # none of the pipeline's tasks or signals
app.conf.task_routes = {"leasetest.hold": {"queue": "leasetest"}}
app.conf.worker_send_task_events = False

STARTED, DONE, RESULTS = "leasetest:started", "leasetest:done", "leasetest:results"


def _redis() -> redis.Redis:
    return redis.Redis.from_url(os.environ["LLMPIPE_REDIS_URL"])


@app.task(name="leasetest.hold")
def hold(key: str, seconds: float) -> str:
    r = _redis()
    r.hincrby(STARTED, key, 1)
    time.sleep(seconds)
    # idempotent output: the first result stored wins, a later run returns it
    r.hsetnx(RESULTS, key, f"{key} by {os.getpid()}")
    r.hincrby(DONE, key, 1)
    return r.hget(RESULTS, key).decode()
