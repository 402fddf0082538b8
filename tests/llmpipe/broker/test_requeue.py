"""RequeueRequest: a task failed by an unreachable broker or Redis is requeued, not failed. No worker:
Celery's own Request on a mock message (celery.contrib.testing.mocks)."""

from unittest.mock import Mock

import pytest
import redis
from billiard.einfo import ExceptionInfo
from celery import Celery
from celery.contrib.testing.mocks import TaskMessage
from kombu.exceptions import OperationalError

from llmpipe.broker.requeue import RequeueRequest, RequeueTask, requeued_on


@pytest.fixture
def app():
    a = Celery(set_as_current=False, task_cls=RequeueTask)
    a.conf.task_acks_late = True
    return a


def _stage(msg):
    return msg


def _request(app, name="stage"):
    task = app.task(name=name)(_stage)
    assert task.Request == "llmpipe.broker.requeue:RequeueRequest"
    msg = TaskMessage(name, args=({"job_id": "j"},))
    # what the worker's strategy passes: the message's ack and reject
    msg.on_ack, msg.on_reject = Mock(), Mock()
    return RequeueRequest(msg, app=app, task=task, on_ack=msg.on_ack, on_reject=msg.on_reject), msg


def _einfo(exc):
    try:
        raise exc
    except Exception:
        return ExceptionInfo()


@pytest.mark.parametrize("exc", [
    OperationalError("Error 111 connecting to 127.0.0.1:6379. Connection refused."),  # the next stage refused
    # the job store's Redis gone mid-body, past the client's retries (RabbitMQ as the broker)
    redis.ConnectionError("Error while reading from redis:6379 : (104, 'Connection reset by peer')"),
], ids=["broker", "job-store"])
def test_an_unreachable_broker_or_job_store_requeues_the_message(app, exc):
    req, msg = _request(app)
    req.on_failure(_einfo(exc))
    msg.on_reject.assert_called_once()
    assert msg.on_reject.call_args.args[-1] is True  # requeue
    msg.on_ack.assert_not_called()


def test_a_requeue_the_broker_refuses_too_is_left_to_the_broker(app):
    req, msg = _request(app)
    msg.on_reject.side_effect = OperationalError("broker away")
    req.on_failure(_einfo(OperationalError("broker away")))  # does not raise: the broker redelivers it
    msg.on_reject.assert_called_once()
    msg.on_ack.assert_not_called()


def test_any_other_failure_is_handled_as_celery_does(app):
    req, msg = _request(app)
    req.on_failure(_einfo(RuntimeError("the body failed")), return_ok=True)
    msg.on_reject.assert_not_called()
    msg.on_ack.assert_called_once()  # acks_late: acked on failure (Celery's default)


def test_only_an_unreachable_broker_or_redis_requeues():
    assert requeued_on(OperationalError("x")) and not requeued_on(RuntimeError("x")) and not requeued_on(None)
    # the job store's Redis restarting (on RabbitMQ it is not the broker), or a failover's replica
    for exc in (redis.ConnectionError("reset"), redis.TimeoutError("slow"), redis.ReadOnlyError("replica"),
                redis.BusyLoadingError("loading")):
        assert requeued_on(exc), exc
    assert not requeued_on(redis.ResponseError("WRONGTYPE"))  # a bug, not an outage
