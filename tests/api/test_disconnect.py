"""A client that goes away has its job cancelled at once, streaming or not (the API under a
real uvicorn server, real Redis, no workers). That the engine then aborts is
tests/integration/test_api_guarantees.py."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from llmpipe.jobs.cancel import CHANNEL
from llmpipe.local.redis_server import free_port
from llmpipe.settings import Settings


@pytest.fixture
def server(redis_client, redis_url, tmp_path, tiny_model):
    from api.app import create_app

    port = free_port()
    app = create_app(Settings(redis_url=redis_url, state_dir=tmp_path, model=tiny_model))
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    end = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < end and t.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", port, app.state.waiter
    srv.should_exit = True
    t.join(10)


class CancelWatch:
    """When each job's cancel broadcast (what the inference worker acts on) arrived."""

    def __init__(self, r):
        self.at: dict[str, float] = {}
        self._ps = r.pubsub(ignore_subscribe_messages=True)
        self._ps.subscribe(CHANNEL)
        self._stop = False
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop:
            m = self._ps.get_message(timeout=0.1)
            if m and m["type"] == "message":
                self.at.setdefault(m["data"].decode(), time.time())

    def close(self):
        self._stop = True
        self._t.join(2)
        self._ps.close()


def _only_job(r) -> str:
    keys = list(r.scan_iter("llmpipe:job:*"))
    assert len(keys) == 1, keys
    return keys[0].decode().removeprefix("llmpipe:job:")


def test_a_streaming_client_that_disconnects_cancels_its_job(server, redis_client, helpers):
    url, _, waiter = server
    watch = CancelWatch(redis_client)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "stream": True}
    try:
        with httpx.Client(timeout=10) as c, c.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()  # kept: a dropped line iterator closes the response
            first = next(ln for ln in lines if ln.startswith("data: "))
            job_id = json.loads(first[6:])["id"].removeprefix("chatcmpl-")
            assert helpers.wait_for(lambda: helpers.waiting(waiter, redis_client, job_id) == 1)
            gone_at = time.time()
        assert helpers.wait_for(lambda: job_id in watch.at, 5)
    finally:
        watch.close()
    assert watch.at[job_id] - gone_at < 1.0
    rec = redis_client.hgetall(f"llmpipe:job:{job_id}")
    assert rec[b"status"] == b"cancelled" and rec[b"abandoned"] == b"1"
    assert redis_client.exists(f"llmpipe:cancelled:{job_id}")
    assert helpers.wait_for(lambda: waiter.watchers(job_id) == 0)


def _raw_post(port: int, path: str, body: dict, headers: dict | None = None) -> socket.socket:
    data = json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
              f"{extra}\r\n".encode() + data)
    return s


def test_a_non_streaming_client_that_disconnects_cancels_its_job(server, redis_client, helpers):
    url, port, waiter = server
    watch = CancelWatch(redis_client)
    try:
        s = _raw_post(port, "/v1/completions", {"prompt": "hi", "max_tokens": 50})
        assert helpers.wait_for(lambda: list(redis_client.scan_iter("llmpipe:job:*")))
        job_id = _only_job(redis_client)
        assert helpers.wait_for(lambda: helpers.waiting(waiter, redis_client, job_id) == 1)
        s.close()
        gone_at = time.time()
        assert helpers.wait_for(lambda: job_id in watch.at, 5)
    finally:
        watch.close()
    assert watch.at[job_id] - gone_at < 1.0
    assert redis_client.hget(f"llmpipe:job:{job_id}", "status") == b"cancelled"


def test_a_job_is_cancelled_only_when_its_last_waiting_client_leaves(server, redis_client, helpers):
    """Two attempts of one request (Idempotency-Key) wait on one job: the first one leaving
    does not cancel it for the second."""
    url, port, waiter = server
    body = {"prompt": "hi", "max_tokens": 50}
    a = _raw_post(port, "/v1/completions", body, {"Idempotency-Key": "k"})
    assert helpers.wait_for(lambda: list(redis_client.scan_iter("llmpipe:job:*")))
    job_id = _only_job(redis_client)
    b = _raw_post(port, "/v1/completions", body, {"Idempotency-Key": "k"})
    key = f"llmpipe:job:{job_id}"
    assert helpers.wait_for(lambda: redis_client.hget(key, "waiters") == b"2")
    a.close()
    assert helpers.wait_for(lambda: redis_client.hget(key, "waiters") == b"1")
    assert redis_client.hget(key, "status") == b"queued"
    b.close()
    assert helpers.wait_for(lambda: redis_client.hget(key, "status") == b"cancelled")
