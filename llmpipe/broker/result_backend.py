"""Celery's Redis result backend, with a defined end when Redis is down after a task's body.

After a task's body, Celery records its outcome in Redis (the chord counter, a failure's
state and chain). When that raises (Redis restarting), Celery's tracer records a failure
instead, which writes to Redis too and raises again, out of the tracer ("Exception raised
outside body"). The prefork pool turns that into a failure and acks; the threads pool of
the inference worker drops it, so the message is neither acked nor rejected. On RabbitMQ
such a message stays unacked on the live consumer for good, holding a prefetch slot: after
``prefetch`` of them the worker receives nothing more (docs/reliability.md, "Redis
restart"). The Redis broker only hid it, by redelivering unacked messages of live workers.

So recording an outcome here retries Redis connection errors with backoff for
``outcome_retry_s`` (a restart takes seconds: the job then completes), and past that logs
and returns: Celery acks the message, and the deadline watchdog settles the job
(``expired``, its typed error) once Redis answers. Other errors propagate as before.

A failure that is the broker refusing the next stage (llmpipe/broker/requeue.py) is not recorded:
its message is requeued, and its next delivery records the outcome.

A result is stored and published in one pipelined round trip without Celery's ``MULTI`` /
``EXEC`` around it (two of a request's Redis commands): Redis runs a connection's commands in
order, so a subscriber woken by the ``PUBLISH`` finds the value already stored; and when the
round trip fails part way, Celery's retry (``ensure``) stores and publishes both again, as it
does after a failed transaction.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from celery import states
from celery.backends.redis import RedisBackend, SentinelBackend

from llmpipe.broker.requeue import requeued_on
from llmpipe.settings import get_settings

log = logging.getLogger("llmpipe.broker.result_backend")


class OutcomeRedisBackend(RedisBackend):
    #: Injectable for tests (fake clock): ``clock`` returns monotonic seconds; ``pause`` sleeps.
    clock: Callable[[], float] = staticmethod(time.monotonic)
    pause: Callable[[float], None] = staticmethod(time.sleep)

    def __init__(self, *args: Any, outcome_retry_s: float | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if outcome_retry_s is None:
            outcome_retry_s = get_settings().outcome_retry_s
        self.outcome_retry_s = outcome_retry_s

    def mark_as_done(self, task_id, result, request=None, store_result=True, state=states.SUCCESS):
        return self._record("success", task_id, lambda: super(OutcomeRedisBackend, self).mark_as_done(
            task_id, result, request=request, store_result=store_result, state=state))

    def mark_as_failure(self, task_id, exc, traceback=None, request=None, store_result=True, call_errbacks=True,
                        state=states.FAILURE):
        if requeued_on(exc):  # not a failure: the message is requeued and its next delivery records the outcome
            return None
        if request is None:
            # Not the running task's outcome: Celery failing a chord's callback after a join
            # or cleanup error, possibly after it sent the callback. As before: it raises,
            # and the header's own outcome write (mark_as_done) retries the chord return,
            # which counts each header once.
            return super().mark_as_failure(task_id, exc, traceback=traceback, request=request,
                                           store_result=store_result, call_errbacks=call_errbacks, state=state)
        return self._record("failure", task_id, lambda: super(OutcomeRedisBackend, self).mark_as_failure(
            task_id, exc, traceback=traceback, request=request, store_result=store_result,
            call_errbacks=call_errbacks, state=state))

    def _set(self, key, value, expires=None):
        if expires is None:
            expires = self.expires
        with self.client.pipeline(transaction=False) as pipe:
            pipe.set(key, value, ex=expires or None)
            pipe.publish(key, value)
            pipe.execute()

    def _record(self, what: str, task_id: str, write: Callable[[], Any]) -> Any:
        started = self.clock()
        delay = 0.05
        attempt = 0
        while True:
            attempt += 1
            try:
                return write()
            except Exception as exc:
                if not self.exception_safe_to_retry(exc):
                    raise
                waited = self.clock() - started
                if waited + delay > self.outcome_retry_s:
                    log.error("task=%s could not record its %s in Redis for %.1fs (%d attempts; %s: %s): the message "
                              "is acked and the deadline watchdog settles the job", task_id, what, waited, attempt,
                              type(exc).__name__, exc)
                    return None
                if attempt == 1:
                    log.warning("task=%s recording its %s failed (%s: %s); retrying for up to %.0fs", task_id, what,
                                type(exc).__name__, exc, self.outcome_retry_s)
                self.pause(delay)
                delay = min(1.0, delay * 2)


class OutcomeSentinelBackend(OutcomeRedisBackend, SentinelBackend):
    """The same bounded outcome retry for a ``sentinel://`` result backend: a failover is a
    Redis outage of a few seconds, which the retry spans."""
