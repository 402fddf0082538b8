"""A task that raised (llmpipe/jobs/deadletter.py TaskFailures): a dead letter, and its job ends failed."""

from __future__ import annotations

from llmpipe.jobs.deadletter import DeadLetters, TaskFailures
from llmpipe.jobs.store import JobStore
from llmpipe.messages import JobStatus


def test_a_stage_task_failure_is_dead_lettered_and_fails_its_job(redis_client):
    jobs, dl = JobStore(redis_client, 60), DeadLetters(redis_client)
    jobs.create("tf", n_prompts=2, deadline=1e12)
    TaskFailures(dl, jobs).record("llmpipe.postprocess", "task-1", ValueError("boom"), ({"job_id": "tf", "index": 1},))
    [entry] = dl.list()
    assert {k: entry[k] for k in ("stage", "reason", "message", "job_id", "request_id", "task", "task_id")} == {
        "stage": "postprocess", "reason": "task_failure", "message": "ValueError: boom", "job_id": "tf",
        "request_id": "tf-1", "task": "llmpipe.postprocess", "task_id": "task-1"}
    rec = jobs.get("tf")
    assert rec.status == JobStatus.FAILED
    assert rec.error == {"type": "internal_error", "message": "ValueError: boom", "stage": "postprocess"}


def test_a_chord_callback_failure_names_its_job_by_keyword_and_bookkeeping_never_raises(redis_client):
    jobs, dl = JobStore(redis_client, 60), DeadLetters(redis_client)
    jobs.create("cb", n_prompts=2, deadline=1e12)
    TaskFailures(dl, jobs).record("llmpipe.collect", "cb", RuntimeError("x"), ([{}, {}],), {"job_id": "cb"})
    [entry] = dl.list()
    assert entry["stage"] == "collect" and entry["job_id"] == "cb" and "request_id" not in entry
    assert jobs.get("cb").status == JobStatus.FAILED

    class Broken:
        def record(self, **_):
            raise RuntimeError("redis away")

    TaskFailures(Broken(), jobs).record("llmpipe.inference", "t", ValueError("y"), ({"job_id": "cb"},))
