"""A job of one prompt is one chain, no chord: its postprocess task collects it. Real
Redis and the tiny model's tokenizer, no worker processes (the task bodies are called)."""

from __future__ import annotations

import json
import time

import pytest
from celery import chain

import workers.context
from llmpipe.celery_app import app
from llmpipe.jobs.memo import memo_key
from llmpipe.jobs.store import JobStore
from llmpipe.messages import FinishReason, Generation, JobStatus, StageTiming
from llmpipe.settings import Settings


def _sigs(n: int):
    header = [chain(app.signature("llmpipe.preprocess", args=({"i": i},)), app.signature("llmpipe.inference"),
                    app.signature("llmpipe.postprocess")) for i in range(n)]
    return header, app.signature("llmpipe.collect", kwargs={"job_id": "J", "submitted_at": 1.0})


def test_one_prompt_is_its_chain_with_postprocess_collecting_and_several_are_a_chord():
    from api.jobs.service import chord

    header, body = _sigs(1)
    single = chord(header, body)
    assert [t.task for t in single.tasks] == ["llmpipe.preprocess", "llmpipe.inference", "llmpipe.postprocess"]
    assert single.tasks[-1].kwargs == {"job_id": "J", "submitted_at": 1.0}
    assert header[0].tasks[-1].kwargs == {}  # the header it was made from is left as it was
    single.freeze("J")
    assert single.tasks[-1].id == "J"  # its stored result is where the chord callback's would be
    header, body = _sigs(2)
    many = chord(header, body)
    assert many.task == "celery.chord" and many.body.task == "llmpipe.collect"


@pytest.fixture
def ctx(redis_url, tiny_model, monkeypatch):
    c = workers.context.WorkerContext(Settings(redis_url=redis_url, model=tiny_model, max_queue_depth=0,
                                               max_queued_prompt_tokens=0))
    monkeypatch.setattr(workers.context, "_context", c)
    yield c
    c.shutdown_all()


def _generation(job_id: str, now: float) -> dict:
    t = StageTiming(stage="inference", enqueued_at=now - 0.02, started_at=now - 0.01, finished_at=now)
    return Generation(job_id=job_id, index=0, deadline=now + 60, enqueued_at=now, prompt_tokens=3,
                      output_token_ids=[5, 6, 7, 8], finish_reason=FinishReason.LENGTH, batch_size=1,
                      engine_time_s=0.01, timings=[t]).model_dump(mode="json", exclude_none=True)


def test_postprocess_writes_the_result_once_and_a_redelivery_returns_the_recorded_one(ctx, redis_client):
    from tasks.postprocess import postprocess

    now = time.time()
    job_id = "single1"
    ctx.jobs.create(job_id, n_prompts=1, deadline=now + 60, now=now)
    redis_client.hset(memo_key(f"{job_id}-0"), "inference", "{}")  # what inference memoised
    msg = _generation(job_id, now)

    first = postprocess.run(msg, job_id=job_id, submitted_at=now)
    rec = JobStore(redis_client, 60).get(job_id)
    assert rec.status == JobStatus.SUCCEEDED and json.loads(rec.result_json) == first
    assert first["results"][0]["token_ids"] == [5, 6, 7, 8] and first["usage"]["completion_tokens"] == 4
    assert not redis_client.exists(memo_key(f"{job_id}-0"))  # the job's memos are dropped once collected

    # Delivered again (its worker died before the ack): it runs again (its timings differ), but
    # the record keeps the first result, and the task returns that same result.
    second = postprocess.run(msg, job_id=job_id, submitted_at=now)
    again = JobStore(redis_client, 60).get(job_id)
    assert second == first
    assert again.result_json == rec.result_json and again.updated_at == rec.updated_at


def test_postprocess_of_a_job_cancelled_meanwhile_leaves_its_record_alone(ctx, redis_client):
    from tasks.postprocess import postprocess

    now = time.time()
    job_id = "single2"
    ctx.jobs.create(job_id, n_prompts=1, deadline=now + 60, now=now)
    assert ctx.jobs.stop(job_id, JobStatus.CANCELLED, {"type": "cancelled", "message": "by the client"})
    out = postprocess.run(_generation(job_id, now), job_id=job_id, submitted_at=now)
    rec = ctx.jobs.get(job_id)
    assert rec.status == JobStatus.CANCELLED and rec.result_json is None
    assert out["status"] == "succeeded"  # what it computed; only the watchdog would read it


def test_preprocess_starts_the_job_and_skips_one_that_ended(ctx, redis_client):
    from tasks.preprocess import preprocess

    now = time.time()
    base = {"index": 0, "deadline": now + 60, "enqueued_at": now, "prompt": "Hello there", "params": {"max_tokens": 4}}
    ctx.jobs.create("pre1", n_prompts=1, deadline=now + 60, now=now)
    out = preprocess.run({**base, "job_id": "pre1"})
    assert "error" not in out and out["prompt_token_ids"]
    assert ctx.jobs.get("pre1").status == JobStatus.RUNNING

    ctx.jobs.create("pre2", n_prompts=1, deadline=now + 60, now=now)
    ctx.jobs.stop("pre2", JobStatus.CANCELLED, {"type": "cancelled", "message": "x"})
    out = preprocess.run({**base, "job_id": "pre2"})
    assert out["error"]["reason"] == "cancelled" and out["prompt_token_ids"] == []
    ctx.jobs.create("pre3", n_prompts=1, deadline=now + 60, now=now)
    ctx.jobs.stop("pre3", JobStatus.EXPIRED, {"type": "expired", "message": "x"})
    assert preprocess.run({**base, "job_id": "pre3"})["error"]["reason"] == "expired"
