"""Many jobs submitted at once over a slow link to Redis must not exhaust Celery's producer
pool: a chord of chains holds two producers at once (celery/celery#5220), and the API
once hung for good at 64 concurrent POSTs with a 20 ms round trip to Redis."""

from __future__ import annotations

import asyncio
import threading
import time

import redis
from celery import Celery

import celeryconfig
from api.jobs.service import JobService
from llmpipe.broker.polling_backend import polling_backend_url
from llmpipe.jobs.admission import Admission
from llmpipe.jobs.store import JobStore
from llmpipe.messages import SamplingParams
from llmpipe.settings import Settings
from llmpipe.testing.hosts.proxy import DelayProxy


def _start_proxy(target_port: int, delay_s: float):
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box = {}

    def run():
        asyncio.set_event_loop(loop)
        box["proxy"] = loop.run_until_complete(DelayProxy(("127.0.0.1", 0), ("127.0.0.1", target_port), delay_s).start())
        ready.set()
        loop.run_forever()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    ready.wait(10)
    return loop, box["proxy"]


def test_concurrent_submissions_beyond_half_the_pool_all_get_through(redis_server, redis_client):
    loop, proxy = _start_proxy(redis_server.port, 0.010)
    url = f"redis://127.0.0.1:{proxy.port}/0"
    app = Celery("submit-test", broker=url, backend=polling_backend_url(url))  # as the API does
    # A small pool makes the old deadlock certain.
    app.conf.update(broker_pool_limit=4, task_serializer="json", task_routes=celeryconfig.task_routes)
    r = redis.Redis.from_url(url)
    service = JobService(app, JobStore(r, 3600), Settings(redis_url=url), Admission(r, max_queue_depth=0,
                                                                                     max_queued_tokens=0))
    params = SamplingParams(max_tokens=4)
    ids: list[str] = []

    def submit(i: int) -> None:
        ids.append(service.submit_inputs([{"prompt": f"p{i}a"}, {"prompt": f"p{i}b"}], params, timeout=60))

    # Daemon threads: a regression deadlocks them for good, and they must not hold up exit.
    threads = [threading.Thread(target=submit, args=(i,), daemon=True) for i in range(16)]
    try:
        for t in threads:
            t.start()
        end = time.monotonic() + 60
        for t in threads:
            t.join(timeout=max(0.0, end - time.monotonic()))
    finally:
        r.close()
        asyncio.run_coroutine_threadsafe(proxy.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
    assert not any(t.is_alive() for t in threads), "submissions hung: the producer pool deadlocked"
    assert len(set(ids)) == 16
    assert redis_client.llen("preprocess") == 32  # every chain's first task was published
