"""The brokers the tests run on (docs/reliability.md, "RabbitMQ"), and kombu producers and
consumers on llmpipe's lease transport for tests that drive it without Celery.

The pipelines that exercise the broker run once per broker in LLMPIPE_TEST_BROKERS (default
both). A test on such a pipeline runs on RabbitMQ only when it is marked ``each_broker``
(tests/harness/plugin.py deselects the others), so the second broker costs only the tests it
can change. Each session gets a RabbitMQ vhost of its own where rabbitmqctl is there."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from urllib.parse import quote

import kombu.pools
import pytest
from kombu import Connection, Consumer, Producer, Queue

from llmpipe.stages import STAGE_QUEUES

TEST_BROKERS = [b.strip() for b in os.environ.get("LLMPIPE_TEST_BROKERS", "redis,rabbitmq").split(",") if b.strip()]
AMQP_URL = os.environ.get("LLMPIPE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
TRANSPORT = "llmpipe.broker.redis_transport:Transport"


def broker_unreachable(what: str):
    """In CI a broker that is not there fails the test; elsewhere it skips, with the reason."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{what} (CI=true: a missing broker fails, never skips)", pytrace=False)
    pytest.skip(what)


def rabbitmqctl(*args: str) -> bool:
    """Runs ``rabbitmqctl -q ARGS``; False when it is not installed or fails."""
    exe = shutil.which("rabbitmqctl")
    if exe is None:
        return False
    try:
        return subprocess.run([exe, "-q", *args], capture_output=True, timeout=60, stdin=subprocess.DEVNULL).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def check_rabbitmq(url: str = AMQP_URL) -> None:
    """Skips (fails under CI) when RabbitMQ does not answer at ``url``."""
    try:
        with Connection(url, connect_timeout=3) as c:
            c.ensure_connection(max_retries=1)
    except Exception as exc:
        broker_unreachable(f"RabbitMQ at {url} is unreachable: {type(exc).__name__}: {exc}")


def make_vhost(name: str) -> str | None:
    """An AMQP URL on a new vhost ``name`` (rabbitmqctl), or None where it cannot be made."""
    if rabbitmqctl("add_vhost", name) and rabbitmqctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*"):
        return AMQP_URL.rstrip("/") + "/" + quote(name, safe="")
    return None


def delete_vhost(name: str) -> None:
    rabbitmqctl("delete_vhost", name)


def reset_broker_queues(url: str) -> None:
    """A fresh pipeline starts on empty stage queues (RabbitMQ: delete them)."""
    with Connection(url, connect_timeout=3) as c:
        for q in STAGE_QUEUES:
            ch = c.channel()
            try:
                ch.queue_delete(q)
            except Exception:  # not declared yet
                pass
            finally:
                try:
                    ch.close()
                except Exception:
                    pass


def forget_broker_pools() -> None:
    """For a test that restarted a Redis on the same URL: kombu keeps one pool of broker
    connections per URL for the whole process (kombu.pools, shared by every Celery app), so
    a Celery app made afterwards would be handed a connection to the old server and fail
    with "Connection closed by server". Forgotten, the pools are made anew on next use;
    apps that hold theirs already keep it (and reconnect as they do in service)."""
    kombu.pools.connections.clear()
    kombu.pools.producers.clear()


# -- kombu on the lease transport ----------------------------------------------------------
def connect(url: str, **options) -> Connection:
    """A kombu connection on llmpipe's lease transport (llmpipe/broker/redis_transport.py)."""
    return Connection(url, transport=TRANSPORT, transport_options=options)


def publish(url: str, queue: str, *bodies) -> None:
    """Each body as one JSON message on ``queue``."""
    with connect(url) as conn:
        p = Producer(conn.channel())
        for b in bodies:
            p.publish(b, routing_key=queue, serializer="json", declare=[Queue(queue)])


def drain(conn: Connection, queue: str, n: int, timeout: float = 10.0, ack: bool = True) -> list:
    """Up to ``n`` (body, message) pairs from ``queue``, within ``timeout``; acked unless ``ack`` is false."""
    got = []

    def on(body, msg):
        got.append((body, msg))
        if ack:
            msg.ack()

    with Consumer(conn.channel(), [Queue(queue)], callbacks=[on], accept=["json"]):
        end = time.monotonic() + timeout
        while len(got) < n and time.monotonic() < end:
            try:
                conn.drain_events(timeout=0.5)
            except TimeoutError:
                pass
    return got
