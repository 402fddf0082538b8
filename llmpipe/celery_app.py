"""The Celery app. Importing it loads no task code, no torch and no vLLM: the API uses it
only to send tasks by name."""

import os
import warnings

from celery import Celery
from celery.exceptions import SecurityWarning

from llmpipe.settings import get_settings


def root_is_expected(allow_root: bool | None) -> bool:
    """Whether running as root is on purpose: said so, or inside a container."""
    if allow_root is not None:
        return allow_root
    return os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv")


# Celery's "running the worker with superuser privileges" warning comes at every worker
# start, before any of our modules run; as root on purpose it is noise. It is a Python
# warning, so a warnings filter set here (the app loads before the worker) silences it.
if root_is_expected(get_settings().allow_root):
    warnings.filterwarnings("ignore", category=SecurityWarning, message=".*superuser privileges")

# Tasks requeue a message whose next stage the broker refused (llmpipe/broker/requeue.py),
# and reach their worker process's context as self.ctx (workers/stage_task.py). By string:
# this module imports nothing from workers. A single inference worker's own queue is
# declared as llmpipe/broker/worker_queues.py says, by whoever names it first. Task events
# go out from a thread of each process, so no hop waits for them
# (llmpipe/observability/task_events.py).
app = Celery("llmpipe", task_cls="workers.stage_task:StageTask", amqp="llmpipe.broker.worker_queues:AMQP",
             events="llmpipe.observability.task_events:Events")
app.config_from_object("celeryconfig")
