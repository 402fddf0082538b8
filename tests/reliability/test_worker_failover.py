"""Failover between the inference workers of one model (docs/reliability.md, "Several
inference workers"): two workers of the tiny model on vLLM, one killed with ``kill -9``
while it holds requests, and nothing restarted (no supervisor here): the other worker
finishes everything.

- every job succeeds exactly once: one result write per job, one engine completion per
  request (the engines hold each batch at its start until the kill, so the dead worker
  completed nothing);
- what the dead worker held, and what routing sent it until its membership expired, is back
  on a queue the survivor takes within lease_ttl_s + lease_sweep_interval_s; its own queue
  is empty from then on;
- a streamed request the dead worker was generating resumes on the other from the tokens it
  had published: the streamed text equals the job's final text, no token lost or repeated.
"""

from __future__ import annotations

import time

import pytest

from tests.harness.multiworker import (
    Stream,
    inference_children,
    is_member,
    own_depth,
    routing_load,
    start_workers_pipe,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.each_broker]

JOBS = 40
STREAMS = 6
HOLD_S = 60.0  # the holds (at a batch's start, at a token), released by the kill at the latest


@pytest.fixture(scope="module")
def pipe(rel, tmp_path_factory, tiny_model, broker_url):
    p = start_workers_pipe(tmp_path_factory.mktemp("failover"), model=tiny_model, broker_url=broker_url,
                           faults={"hold_at_tokens": HOLD_AT_TOKENS})
    yield p
    rel.stop_pipe(p)


STREAM_TOKENS = 256
# The resume test's engines stop at a stream's HOLD_AT_TOKENS-th token until the kill, so that
# the victim cannot finish its streams before the last stream's text reaches the test (with
# 256 tokens and no such hold, it had once on RabbitMQ). An engine's streams run in step, but
# their batches leave the start hold up to one poll (50 ms, a few of the tiny model's steps)
# apart: at the first one's 64th token, the others have tokens published too.
HOLD_AT_TOKENS = 64
# The resume test's jobs may live this long, and the test waits as long for their streams: its
# subject is the resume, not the deadline.
STREAM_TIMEOUT_S = 600.0


def body(i: int, text: str, max_tokens: int = 8) -> dict:
    return {"prompt": f"{text} {i} and then", "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True}


def final_text(pipe, job: str) -> str:
    return pipe.view(job)["result"]["results"][0]["text"]


def _back_for_good(pipe, victim: str, lease: str | None) -> bool:
    """Nothing of the dead worker is left: routing no longer sees it, its own queue is empty,
    and what it held is released (Redis: its lease swept; RabbitMQ: its consumers dropped)."""
    return not is_member(pipe, victim) and own_depth(pipe, victim) == 0 and pipe.swept(lease)


def _ready(pipe, rel, child: str) -> None:
    if not pipe.alive(child):
        pipe.respawn(child, timeout=240)
    rel.wait_until(lambda: is_member(pipe, child), 60, what=f"{child} in routing")


def test_kill9_of_one_worker_hands_its_requests_to_the_other_and_every_job_ends_once(pipe, rel):
    victim, survivor = inference_children(pipe)
    for c in (victim, survivor):
        _ready(pipe, rel, c)
    pipe.reset_ledger()
    watch = rel.ResultWatch(pipe.s.redis_url)
    pipe.set_delay("batch", HOLD_S)
    try:
        with rel.MemSampler(pipe) as mem:
            ids = [pipe.submit(body(i, "failover")) for i in range(JOBS - STREAMS)]
            streams = [Stream(pipe.lp.api_url, body(i, "failover stream", 16)) for i in range(STREAMS)]
            rel.wait_until(lambda: routing_load(pipe, victim) >= 1 and routing_load(pipe, survivor) >= 1, 60,
                           what="both workers holding requests")
            rel.wait_until(lambda: all(s.opened for s in streams), 60, what="the streams' jobs created")
            held = routing_load(pipe, victim)
            lease = pipe.lease(victim)
            t_kill = pipe.kill(victim)
            pipe.clear_delays()
            # routing still sees the dead worker until its membership expires: some of these go its way
            late = [pipe.submit(body(i, "after the kill")) for i in range(10)]
            rel.wait_until(lambda: _back_for_good(pipe, victim, lease), rel.RECOVERY_S + 30, every=0.05,
                           what="the dead worker's requests back on a live queue")
            back_s = time.time() - t_kill
            texts = [s.join(120) for s in streams]
            views = pipe.wait_all([*ids, *late, *(s.job for s in streams)], timeout=120)
            watch.wait_seen(views)
    finally:
        watch.close()
        pipe.clear_delays()
    jobs = [*ids, *late, *(s.job for s in streams)]
    started, done = pipe.ledger()
    last_done_s = max(watch.first_at[j] for j in jobs) - t_kill
    row = {
        "scenario": f"kill -9 one of two inference workers ({'rabbitmq' if pipe.amqp else 'redis'}, vLLM)",
        "sent": len(jobs), "completed": sum(v["status"] == "succeeded" for v in views.values()),
        "lost": sum(v["status"] != "succeeded" for v in views.values()),
        "duplicated": len(watch.duplicated(jobs)), "result_writes_gt1": len(watch.published_twice(jobs)),
        "held_by_the_dead_worker": held, "requests_redelivered": sum(1 for j in jobs if started.get(f"{j}-0", 0) > 1),
        "back_after_s": round(back_s, 2), "recovery_s": round(last_done_s, 2), "peak_rss_mb": mem.total_peak_mb,
    }
    rel.record(row)
    assert row["lost"] == 0, {j: v["status"] for j, v in views.items() if v["status"] != "succeeded"}
    assert row["duplicated"] == 0 and row["result_writes_gt1"] == 0, row
    assert all(done.get(f"{j}-0") == 1 for j in jobs), {j: done.get(f"{j}-0") for j in jobs if done.get(f"{j}-0") != 1}
    assert row["requests_redelivered"] >= 1, row  # it really held work
    assert back_s <= rel.RECOVERY_S + rel.SLACK_S, row
    for s, text in zip(streams, texts, strict=True):
        assert text == final_text(pipe, s.job), s.job


@pytest.mark.timeout(STREAM_TIMEOUT_S + 300)
def test_a_stream_the_dead_worker_was_generating_resumes_on_the_other(pipe, rel):
    victim, survivor = inference_children(pipe)
    for c in (victim, survivor):
        _ready(pipe, rel, c)
    pipe.reset_ledger()
    # Every stream is held at its batch's start until all eight are in the engines, so that
    # they start together; then each engine stops at its streams' HOLD_AT_TOKENS-th token
    # until the kill. So the victim surely dies mid-output, with text published.
    pipe.set_delay("batch", HOLD_S)
    pipe.set_delay("tokens", HOLD_S)
    try:
        streams = [Stream(pipe.lp.api_url, {**body(i, "resume stream", STREAM_TOKENS), "timeout": STREAM_TIMEOUT_S})
                   for i in range(8)]
        rel.wait_until(lambda: len(pipe.ledger()[0]) == len(streams), 120, what="every stream held in an engine")
        rel.wait_until(lambda: routing_load(pipe, victim) >= 1, 30, what=f"{victim} holding a stream")
        pipe.clear_delay("batch")
        rel.wait_until(lambda: all(s.text for s in streams), 120, what="every stream under way")
        before = {s.job: s.text for s in streams}
        pipe.kill(victim)
    finally:
        pipe.clear_delays()
    texts = [s.join(STREAM_TIMEOUT_S) for s in streams]
    started, _ = pipe.ledger()
    resumed = [s.job for s in streams if started.get(f"{s.job}-0", 0) > 1]
    assert resumed, "no stream was running on the killed worker"
    for s, text in zip(streams, texts, strict=True):
        assert text.startswith(before[s.job]) and text == final_text(pipe, s.job), s.job
    # the resumed ones had published tokens before the kill, and none was taken back or repeated
    assert all(before[j] for j in resumed)
