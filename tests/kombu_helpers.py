"""Kombu producers and consumers on llmpipe's lease transport, for tests that drive it
without Celery."""

from __future__ import annotations

import time

from kombu import Connection, Consumer, Producer, Queue

TRANSPORT = "llmpipe.broker.redis_transport:Transport"


def connect(url: str, **options) -> Connection:
    return Connection(url, transport=TRANSPORT, transport_options=options)


def publish(url: str, queue: str, *bodies) -> None:
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
