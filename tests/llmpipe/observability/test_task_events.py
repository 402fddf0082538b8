"""The task events' background sender (llmpipe/observability/task_events.py), on the session's
real Redis: events go out in order, ``close`` waits for them, a send does not wait for the
broker (where Celery's own dispatcher does), an event that met a broken connection goes out
on a new one, and one the broker refused twice goes back to its dispatcher's outbound
buffer."""

from __future__ import annotations

import base64
import json
import threading
import time

import pytest
import redis
from celery import Celery
from celery.events.dispatcher import EventDispatcher
from kombu import Connection

from llmpipe.observability.task_events import EventSender, Events, started_sender
from tests.harness.waiting import wait_until

PAUSE_MS = 60_000


@pytest.fixture
def app(redis_url):
    a = Celery("events-test", broker=redis_url, events=Events)
    yield a
    a.close()


@pytest.fixture
def events_seen(redis_client):
    """A subscriber to every event channel; ``read(n)``: the uuids of the next ``n`` events."""
    sub = redis_client.pubsub()
    sub.psubscribe("*celeryev*")
    sub.get_message(timeout=5)  # the subscription's confirmation

    def read(n: int, timeout: float = 10.0) -> list[str]:
        got, end = [], time.monotonic() + timeout
        while len(got) < n and time.monotonic() < end:
            m = sub.get_message(timeout=0.5)
            if m and m["type"] == "pmessage":
                body = json.loads(m["data"])["body"]
                got.append(json.loads(_decoded(body))["uuid"])
        return got

    yield read
    sub.close()


def _decoded(body: str) -> str:
    return base64.b64decode(body).decode()


def _dispatcher(app, cls=None) -> EventDispatcher:
    conn = app.connection_for_write()
    if cls is None:
        return app.events.Dispatcher(conn, hostname="test@host")
    return cls(conn, hostname="test@host", app=app)


def test_events_go_out_in_order_and_close_waits_for_them(app, events_seen):
    d = _dispatcher(app)
    for i in range(50):
        d.send("task-succeeded", uuid=f"t{i}")
    d.close()
    assert events_seen(50) == [f"t{i}" for i in range(50)]


def test_a_dispatcher_that_never_sent_closes_without_starting_a_sender(app):
    d = _dispatcher(app)
    d.close()
    assert started_sender(app) is None
    d = _dispatcher(app)
    d.send("task-succeeded", uuid="t0")
    d.close()
    assert started_sender(app) is not None


def _pause_writes(r: redis.Redis) -> None:
    """Redis holds every write (a PUBLISH too) until ``_unpause``: far longer than a test waits."""
    r.execute_command("CLIENT", "PAUSE", PAUSE_MS, "WRITE")


def _unpause(r: redis.Redis) -> None:
    r.execute_command("CLIENT", "UNPAUSE")


def _held_publishes(r: redis.Redis) -> int:
    """Clients whose PUBLISH the pause holds (blocked: flag ``b``), whatever else waits."""
    return sum("b" in c["flags"] and c["cmd"] == "publish" for c in r.client_list())


def test_a_send_does_not_wait_for_the_broker_where_celerys_own_dispatcher_does(app, events_seen, redis_client):
    d = _dispatcher(app)
    d.send("task-succeeded", uuid="warm")  # the sender's connection is made
    assert events_seen(1) == ["warm"]
    _pause_writes(redis_client)
    try:
        for i in range(10):
            d.send("task-succeeded", uuid=f"p{i}")
        # the sends returned while the broker holds the sender's first publish
        wait_until(lambda: _held_publishes(redis_client) == 1, 10, what="the sender's publish held by the pause")
    finally:
        _unpause(redis_client)
    d.close()  # returns once Redis took them
    assert events_seen(10) == [f"p{i}" for i in range(10)]

    plain = _dispatcher(app, EventDispatcher)
    plain.send("task-succeeded", uuid="warm2")
    assert events_seen(1) == ["warm2"]
    _pause_writes(redis_client)
    try:
        sending = threading.Thread(target=plain.send, args=("task-succeeded",), kwargs={"uuid": "p"}, daemon=True)
        sending.start()
        wait_until(lambda: _held_publishes(redis_client) == 1, 10, what="Celery's publish held by the pause")
        assert sending.is_alive()  # the caller itself waits for the broker
    finally:
        _unpause(redis_client)
    sending.join(10)
    assert not sending.is_alive() and events_seen(1) == ["p"]
    plain.close()


def _dead() -> Connection:
    """A connection to a port nobody listens on, that fails at once."""
    return Connection("redis://127.0.0.1:1/0", connect_timeout=1, transport_options={"max_retries": 0})


def test_an_event_the_broker_refused_twice_goes_back_to_the_outbound_buffer(app):
    d = _dispatcher(app)
    tried = []
    sender = EventSender(lambda: tried.append(1) or _dead())
    event = {"type": "task-succeeded", "uuid": "lost"}
    sender.put(d, event, "task.succeeded")
    assert sender.drain()
    assert list(d._outbound_buffer) == [(event, "task.succeeded")] and len(tried) == 2
    d.close()


def test_an_event_that_met_a_broken_connection_goes_out_on_a_new_one(app, events_seen):
    d = _dispatcher(app)
    connections = iter([_dead(), app.connection_for_write()])
    sender = EventSender(lambda: next(connections))
    sender.put(d, d._prepare_event("task-succeeded", {"uuid": "again"}), "task.succeeded")
    assert sender.drain()
    assert events_seen(1) == ["again"] and not d._outbound_buffer
    d.close()
