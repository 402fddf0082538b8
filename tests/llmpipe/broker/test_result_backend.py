"""OutcomeRedisBackend: recording a task's outcome survives a Redis restart, and gives up
within its bound instead of raising out of Celery's tracer. Fake clock, no Redis, no worker."""

import pytest
import redis
from celery import Celery
from kombu.exceptions import OperationalError

from llmpipe.broker.result_backend import OutcomeRedisBackend


class FakeTime:
    def __init__(self):
        self.t = 0.0
        self.pauses: list[float] = []

    def clock(self):
        return self.t

    def pause(self, s):
        self.pauses.append(s)
        self.t += s


class ChordRequest:
    """What mark_as_done reads of a chord header task's request."""

    id = "t1"
    group = "g1"
    group_index = 0
    chord = {"task": "llmpipe.collect"}
    ignore_result = True
    chain = None
    errbacks = None


def _backend(monkeypatch, fail_times: int, exc: Exception, retry_s: float = 15.0):
    b = OutcomeRedisBackend(app=Celery(), url="redis://127.0.0.1:1/0", outcome_retry_s=retry_s)
    ft = FakeTime()
    monkeypatch.setattr(b, "clock", ft.clock)
    monkeypatch.setattr(b, "pause", ft.pause)
    calls = []

    def part_return(request, state, result, **kw):
        calls.append((request.id, state, result))
        if len(calls) <= fail_times:
            raise exc

    monkeypatch.setattr(b, "on_chord_part_return", part_return)
    return b, ft, calls


def test_a_short_outage_is_ridden_over_and_the_outcome_recorded(monkeypatch):
    b, ft, calls = _backend(monkeypatch, fail_times=5, exc=redis.ConnectionError("refused"))
    b.mark_as_done("t1", {"ok": 1}, request=ChordRequest())
    assert len(calls) == 6 and calls[-1] == ("t1", "SUCCESS", {"ok": 1})
    assert ft.t < 15.0 and ft.pauses == sorted(ft.pauses)  # backoff grows


def test_a_long_outage_ends_within_the_bound_without_raising(monkeypatch):
    b, ft, calls = _backend(monkeypatch, fail_times=10**6, exc=redis.ConnectionError("refused"), retry_s=15.0)
    assert b.mark_as_done("t1", {"ok": 1}, request=ChordRequest()) is None
    assert 10.0 <= ft.t <= 15.0 and max(ft.pauses) <= 1.0
    assert len(calls) > 10


def test_a_failure_is_recorded_the_same_way(monkeypatch):
    b, ft, calls = _backend(monkeypatch, fail_times=10**6, exc=redis.TimeoutError("read timed out"), retry_s=3.0)
    b.mark_as_failure("t1", RuntimeError("boom"), request=ChordRequest(), store_result=False)
    assert calls and all(c[1] == "FAILURE" for c in calls) and ft.t <= 3.0


def test_other_errors_still_propagate_at_once(monkeypatch):
    b, ft, calls = _backend(monkeypatch, fail_times=1, exc=ValueError("cannot encode"))
    with pytest.raises(ValueError):
        b.mark_as_done("t1", {"ok": 1}, request=ChordRequest())
    assert len(calls) == 1 and ft.pauses == []


def _traced(monkeypatch, backend_url: str, body):
    """Run a chord header task through Celery's own tracer (what a worker's pool thread
    runs), with Redis refusing every outcome write after the body."""
    from celery.app.trace import build_tracer

    app = Celery(set_as_current=False)
    app.conf.result_backend = backend_url
    name = f"header.{body.__name__}"  # Celery warns when one name is given two callables
    task = app.task(name=name, ignore_result=True)(body)
    b = app.backend
    ft = FakeTime()
    monkeypatch.setattr(b, "clock", ft.clock, raising=False)
    monkeypatch.setattr(b, "pause", ft.pause, raising=False)

    def part_return(request, state, result, **kw):
        raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    monkeypatch.setattr(b, "on_chord_part_return", part_return)
    tracer = build_tracer(name, task, app=app, eager=False, propagate=False)
    return tracer("u1", (), {}, {"id": "u1", "group": "g1", "chord": {"task": "collect"}, "group_index": 0})


def _ok():
    return {"ok": 1}


def _fails():
    raise RuntimeError("the body failed")


def test_stock_backend_lets_the_error_escape_celerys_tracer(monkeypatch):
    # The premise: with Celery's Redis backend the tracer raises, and the threads pool
    # then never acks or rejects the message.
    with pytest.raises(redis.ConnectionError):
        _traced(monkeypatch, "redis://127.0.0.1:1/0", _fails)


@pytest.mark.parametrize("body, state", [(_ok, "SUCCESS"), (_fails, "FAILURE")])
def test_the_tracer_returns_when_redis_stays_down_after_the_body(monkeypatch, body, state):
    R, info, _, _ = _traced(monkeypatch, "llmpipe.broker.result_backend:OutcomeRedisBackend+redis://127.0.0.1:1/0", body)
    assert (info.state if info is not None else "SUCCESS") == state  # the pool's callback runs: ack


def _refused():
    raise OperationalError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")


def test_a_refused_next_stage_is_not_recorded_as_a_failure(monkeypatch):
    # The message is requeued instead (llmpipe/broker/requeue.py): a failure in the chord would
    # fail the job whose next delivery succeeds.
    b, ft, calls = _backend(monkeypatch, fail_times=0, exc=None)
    assert b.mark_as_failure("t1", OperationalError("refused"), request=ChordRequest()) is None
    assert calls == [] and ft.pauses == []
    R, info, _, _ = _traced(monkeypatch, "llmpipe.broker.result_backend:OutcomeRedisBackend+redis://127.0.0.1:1/0", _refused)
    assert info.state == "FAILURE" and isinstance(R.exception, OperationalError)  # the Request requeues it


def test_failing_a_chord_callback_is_not_retried_here(monkeypatch):
    # Celery marks a chord's callback failed (no request) from inside the header's chord
    # return; the header's mark_as_done retries that whole return instead.
    b, ft, calls = _backend(monkeypatch, fail_times=0, exc=None)
    monkeypatch.setattr(b, "store_result", lambda *a, **k: (_ for _ in ()).throw(redis.ConnectionError("refused")))
    with pytest.raises(redis.ConnectionError):
        b.mark_as_failure("job-id", RuntimeError("Join error"))
    assert ft.pauses == []


def test_a_result_is_stored_then_published_without_a_transaction(redis_url, redis_client):
    # Celery's tracer, as a worker runs it, on a real Redis.
    from celery.app.trace import build_tracer

    app = Celery(set_as_current=False)
    app.conf.result_backend = f"llmpipe.broker.result_backend:OutcomeRedisBackend+{redis_url}"
    ps = redis_client.pubsub(ignore_subscribe_messages=True)
    ps.subscribe("celery-task-meta-job-1")
    ps.get_message(timeout=1)
    before = {k: int(v["calls"]) for k, v in redis_client.info("commandstats").items()}
    task = app.task(name="llmpipe.postprocess", shared=False)(_ok)  # not registered in llmpipe's own app too
    build_tracer(task.name, task, app=app, eager=False, propagate=False)("job-1", (), {}, {"id": "job-1"})
    after = {k: int(v["calls"]) for k, v in redis_client.info("commandstats").items()}
    delta = {k.removeprefix("cmdstat_"): n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
    assert "multi" not in delta and "exec" not in delta and delta.get("publish") == 1
    msg = ps.get_message(timeout=2)
    assert msg is not None and msg["channel"] == b"celery-task-meta-job-1"  # the subscriber is still woken
    assert app.AsyncResult("job-1").state == "SUCCESS"
    assert 0 < redis_client.ttl("celery-task-meta-job-1") <= app.backend.expires
    ps.close()
