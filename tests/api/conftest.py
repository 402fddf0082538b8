"""Helpers for the API tests (a fixture, since test modules cannot import each other)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.harness.waiting import wait_for


def waiting(waiter, r, job_id: str) -> int:
    """Requests of the API that wait on the job, counted once the waiter listens: its
    subscription to every job's end is confirmed, and Redis has it (api/waiter.py)."""
    n = waiter.watchers(job_id)
    return n if n and waiter.listening and r.pubsub_numpat() >= 1 else 0


def finish_job(redis_client, job_id: str, *, text: str = "hi", error: dict | None = None) -> None:
    """What the chord callback does: the record takes the result and its status."""
    from llmpipe.jobs.store import JobStore
    from llmpipe.messages import JobResult

    results = [{"index": 0, "text": text, "finish_reason": "error" if error else "stop",
                **({"error": error} if error else {})}]
    result = JobResult.model_validate({
        "job_id": job_id, "status": "failed" if error else "succeeded", "results": results,
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}, "error": error})
    assert JobStore(redis_client, 60).finish(result)


@pytest.fixture
def helpers():
    return SimpleNamespace(waiting=waiting, wait_for=wait_for, finish_job=finish_job)
