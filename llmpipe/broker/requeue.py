"""A task that failed only because the broker or Redis was unreachable goes back to its queue.

After its body, a stage publishes the next stage's message (Celery's chain). When the
broker is unreachable then (a Redis broker restarting), Celery fails the task with kombu's
``OperationalError``. A stage's body reads and writes the job store in Redis, which on
RabbitMQ is not the broker: a Redis restart there fails the body with redis-py's connection
errors once the client's retries (llmpipe/broker/redis_clients.py ride_through_retry) run
out. Recorded as a failure, the job would fail (or, with Redis away, be lost until its
deadline) although nothing was wrong with it; so this failure is not recorded
(llmpipe/broker/result_backend.py), not dead-lettered (workers/signals.py), and the message
is rejected with requeue: the broker delivers it again and the stage's memo replays what
was done (llmpipe/jobs/memo.py). When the reject cannot reach the broker either, the broker
redelivers it by itself (RabbitMQ when the connection drops; Redis by its unacked-message
restore).
"""

from __future__ import annotations

import logging

from celery import Task
from celery.worker.request import Request
from celery.worker.state import task_ready
from kombu.exceptions import OperationalError

from llmpipe.broker.redis_clients import UNAVAILABLE_ERRORS
from llmpipe.observability.summaries import args_repr
from llmpipe.settings import get_settings

log = logging.getLogger("llmpipe.worker")


def requeued_on(exc: BaseException | None) -> bool:
    """Whether a task that raised ``exc`` is requeued rather than failed: the broker or Redis
    was unreachable."""
    return isinstance(exc, (OperationalError, *UNAVAILABLE_ERRORS))


class RequeueRequest(Request):
    def on_failure(self, exc_info, send_failed_event=True, return_ok=False):
        exc = getattr(exc_info, "exception", None)
        exc = getattr(exc, "exc", exc)  # ExceptionWithTraceback
        if not (requeued_on(exc) and self.task.acks_late):
            return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)
        task_ready(self)
        log.warning("task=%s[%s] could not reach the broker or Redis (%s: %s); its message goes back to the queue",
                    self.name, self.id, type(exc).__name__, exc)
        try:
            self.reject(requeue=True)
        except Exception as err:  # the broker is away: it redelivers the message itself
            log.warning("task=%s[%s] could not requeue its message (%s: %s); the broker redelivers it",
                        self.name, self.id, type(err).__name__, err)


class RequeueTask(Task):
    """The app's task class (llmpipe/celery_app.py)."""

    Request = "llmpipe.broker.requeue:RequeueRequest"
    # Celery puts saferepr(return value) in each task-succeeded event (Flower) and its
    # success log line: up to 1024 characters of token ids and generated text, walked item
    # by item (~0.16 ms a message). A stage's return value is a message (a dict), so 8
    # characters show only its first key (`{'job_id', ...}`, `{'index', ...}`); the log line gets the summary
    # (workers/task_logging.py). LLMPIPE_LOG_CONTENT=true keeps Celery's 1024.
    resultrepr_maxsize = 1024 if get_settings().log_content else 8

    def apply_async(self, args=None, kwargs=None, task_id=None, producer=None, link=None, link_error=None,
                    shadow=None, **options):
        # Every stage message a worker sends (the chain's next stage, the chord's callback)
        # shows ids and sizes, not the prompt or its token ids (llmpipe/observability/summaries.py).
        if "argsrepr" not in options and not get_settings().log_content:
            options["argsrepr"] = args_repr(args)
        return super().apply_async(args, kwargs, task_id, producer, link, link_error, shadow, **options)
