"""The app's task class: a task reaches its worker process's context as ``self.ctx``.

llmpipe/celery_app.py names it by string (``workers.stage_task:StageTask``), so importing
the app imports nothing from workers; Celery resolves it when a task is defined.
"""

from __future__ import annotations

from llmpipe.broker.requeue import RequeueTask
from workers.context import WorkerContext, context


class StageTask(RequeueTask):
    """RequeueTask (a task whose next stage the broker refused goes back to its queue,
    llmpipe/broker/requeue.py) with the process's WorkerContext."""

    @property
    def ctx(self) -> WorkerContext:
        return context()
