"""The long-poll waiter survives Redis outages: the tests' redis-server is stopped and
started again on its port (always restarted on the way out). No workers: the tests end
jobs as the chord callback would."""

from __future__ import annotations

import threading
import time

import pytest
import redis
from fastapi.testclient import TestClient

from llmpipe.local.redis_server import EmbeddedRedis
from llmpipe.settings import Settings
from tests.harness.brokers import forget_broker_pools


@pytest.fixture
def outage(redis_server, redis_client, tmp_path, tiny_model):
    from api.app import create_app

    # The session's server (the in-process Celery app keeps its broker URL for the session).
    server: EmbeddedRedis = redis_server
    s = Settings(redis_url=server.url, state_dir=tmp_path, model=tiny_model)
    try:
        with TestClient(create_app(s)) as c:
            yield server, c, c.app.state.waiter
    finally:
        if not server.running:
            server.start()
        forget_broker_pools()  # the server restarted: no later Celery app may get a stale connection


def _long_poll(client, job_id, out):
    out["view"] = client.get(f"/v1/jobs/{job_id}", params={"wait": 30}).json()
    out["at"] = time.time()


def test_long_poll_wakes_within_a_second_after_redis_comes_back(outage, helpers):
    server, client, waiter = outage
    # Redis goes away before any request has waited (the waiter has never connected).
    server.stop()
    t0 = time.monotonic()
    r = client.get("/v1/jobs/abc", params={"wait": 30})
    assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable"
    assert r.headers["x-should-retry"] == "true" and r.headers["Retry-After"]
    assert client.post("/v1/jobs", json={"prompt": "x"}).status_code == 503
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 503
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True}).status_code == 503
    assert time.monotonic() - t0 < 15  # failed fast, none waited out its 30 s
    assert waiter.watching == 0  # nothing registered during the outage stays behind

    server.start()
    r = redis.Redis.from_url(server.url)
    job_id = client.post("/v1/jobs", json={"prompt": "x"}).json()["id"]
    out = {}
    t = threading.Thread(target=_long_poll, args=(client, job_id, out))
    t.start()
    assert helpers.wait_for(lambda: helpers.waiting(waiter, r, job_id) == 1, 10)
    done_at = time.time()
    helpers.finish_job(r, job_id)
    t.join(35)
    assert out["view"]["status"] == "succeeded"
    assert out["at"] - done_at < 1.0, out["at"] - done_at
    assert waiter.watching == 0


def test_a_job_that_ends_during_an_outage_wakes_its_long_poll_after_it(outage, helpers):
    """The PUBLISH is lost while the waiter is disconnected; the resubscription wakes the
    watcher, which reads the record."""
    server, client, waiter = outage
    r = redis.Redis.from_url(server.url)
    job_id = client.post("/v1/jobs", json={"prompt": "x"}).json()["id"]
    out = {}
    t = threading.Thread(target=_long_poll, args=(client, job_id, out))
    t.start()
    assert helpers.wait_for(lambda: helpers.waiting(waiter, r, job_id) == 1, 10)
    # kill the waiter's connection only (the record write and its publish happen while no
    # subscriber listens)
    for c in r.client_list():
        if int(c.get("sub", 0)) > 0:
            r.client_kill_filter(_id=c["id"])
    helpers.finish_job(r, job_id)
    done_at = time.time()
    t.join(35)
    assert out["view"]["status"] == "succeeded"
    assert out["at"] - done_at < 2.0, out["at"] - done_at
    # it reconnected by itself, and wakes the next long-poll at once
    assert helpers.wait_for(lambda: waiter.reconnects >= 2, 10)
    job_id = client.post("/v1/jobs", json={"prompt": "y"}).json()["id"]
    out = {}
    t = threading.Thread(target=_long_poll, args=(client, job_id, out))
    t.start()
    assert helpers.wait_for(lambda: helpers.waiting(waiter, r, job_id) == 1, 10)
    done_at = time.time()
    helpers.finish_job(r, job_id)
    t.join(35)
    assert out["view"]["status"] == "succeeded" and out["at"] - done_at < 1.0
    assert waiter.watching == 0


def test_a_waiting_openai_call_sits_out_a_redis_blip(outage, helpers):
    """Its job runs already: a 503 now would make the client retry into a second job."""
    server, client, waiter = outage
    r = redis.Redis.from_url(server.url)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", client.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 2})))
    t.start()
    assert helpers.wait_for(lambda: r.llen("preprocess") == 1, 10)
    job_id = next(iter(r.scan_iter("llmpipe:job:*"))).decode().removeprefix("llmpipe:job:")
    assert helpers.wait_for(lambda: helpers.waiting(waiter, r, job_id) == 1, 10)
    r.save()  # the test server keeps no AOF: the restart loads this snapshot
    server.stop()
    assert helpers.wait_for(lambda: waiter.reconnects >= 1 and waiter._pubsub is None, 10)  # the waiter saw it
    server.start()
    (server.data_dir / "dump.rdb").unlink()
    assert helpers.wait_for(lambda: helpers.waiting(waiter, r, job_id) == 1, 10)
    assert t.is_alive()  # still waiting, not answered
    helpers.finish_job(r, job_id, text=" ok")
    t.join(30)
    assert out["r"].status_code == 200 and out["r"].json()["choices"][0]["text"] == " ok"
