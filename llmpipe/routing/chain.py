"""Sending the next stage of a Celery chain to another queue, from inside the running task.

A job's chain is built by the API with each stage's queue in its options; the task that
runs now holds the rest of the chain (``request.chain``, the next signature last), and Celery
publishes that next signature with those options once the task returns
(celery/app/trace.py). Preprocess sets the inference signature's queue there.
"""

from __future__ import annotations

from typing import Any

from llmpipe.stages import Stage


def next_stage_to(request: Any, queue: str, task: str = Stage.INFERENCE.task) -> bool:
    """Send the chain's next signature to ``queue`` if it is ``task``; True if it was."""
    chain = getattr(request, "chain", None)
    if not chain:
        return False
    nxt = chain[-1]
    if not isinstance(nxt, dict) or nxt.get("task") != task:
        return False
    options = nxt.get("options")
    if options is None:
        options = nxt["options"] = {}
    options["queue"] = queue
    # the queue decides the exchange and routing key (its declaration), not what an earlier hop set
    options.pop("exchange", None)
    options.pop("routing_key", None)
    return True
