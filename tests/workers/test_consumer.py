"""The workers' consumer reconnects every second for as long as the broker is away, and says
so every few seconds (workers/consumer.py)."""

from __future__ import annotations

from celery.worker.consumer import Consumer as CeleryConsumer

from workers.consumer import RECONNECT, RECONNECT_MAX_S, Consumer, every_so_often, reconnecting


def test_a_failed_attempt_is_said_at_first_and_then_every_few_seconds():
    said, now = [], [0.0]
    errback = every_so_often(lambda exc, interval: said.append((exc, interval)), every_s=10.0, clock=lambda: now[0])
    for t in (0.0, 1.0, 2.0, 9.9, 10.0, 11.0, 20.5):
        now[0] = t
        errback(f"refused at {t}", 1.0)
    assert [e for e, _ in said] == ["refused at 0.0", "refused at 10.0", "refused at 20.5"]
    assert every_so_often(None) is None


def test_the_consumer_retries_forever_at_most_a_second_apart():
    calls = []

    class Conn:
        def ensure_connection(self, errback=None, max_retries=None, **kw):
            calls.append((errback, max_retries, kw))
            return self

    conn = Conn()
    with reconnecting(conn):
        # as Celery's consumer calls it (celery/worker/consumer/consumer.py ensure_connected)
        assert conn.ensure_connection(lambda exc, interval: None, 100, callback=print) is conn
    [(errback, max_retries, kw)] = calls
    assert max_retries is None and kw["interval_max"] == RECONNECT_MAX_S == 1.0 and kw["callback"] is print
    assert {k: kw[k] for k in RECONNECT} == RECONNECT and callable(errback)
    assert "ensure_connection" not in vars(conn)  # the connection's own method again
    assert issubclass(Consumer, CeleryConsumer)


def test_the_app_runs_this_consumer():
    from llmpipe.celery_app import app

    assert app.conf.worker_consumer == "workers.consumer:Consumer"
