"""The app's task class: a task reaches its worker process's context as ``self.ctx``.

llmpipe/celery_app.py names it by string (``workers.stage_task:StageTask``), so importing
the app imports nothing from workers; Celery resolves it when a task is defined.
"""

from __future__ import annotations

from llmpipe.broker.requeue import RequeueTask
from llmpipe.routing.chain import next_stage_to
from workers.context import WorkerContext, context


class StageTask(RequeueTask):
    """RequeueTask (a task whose next stage the broker refused goes back to its queue,
    llmpipe/broker/requeue.py) with the process's WorkerContext."""

    @property
    def ctx(self) -> WorkerContext:
        return context()

    def send_next_to(self, queue: str) -> None:
        """Publish the chain's next stage (inference) to ``queue`` instead of the queue the API
        named: a worker's own queue, chosen by prefix-aware routing (llmpipe/routing/)."""
        next_stage_to(self.request, queue)
