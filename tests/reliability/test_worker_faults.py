"""Workers that fail: kill -9, SIGTERM, engine death, a request that kills every worker, a
worker that never comes back, and one stalled past its lease. Real Redis, real Celery workers,
the transformers engine on the tiny model wrapped by the test-only fault injector
(llmpipe/testing/faulty.py), on the shipped lease and visibility settings: a killed
worker's messages come back within lease_ttl_s + lease_sweep_interval_s (5 s). The faults
inside the engine or in the input are in test_engine_faults.py.

Sampling is random (temperature 1, no seed) on purpose: a request the engine ran twice
would come back with different tokens, so "no second, different result" is checked for real.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.harness import faults
from tests.harness.faults import body, request_ids

pytestmark = pytest.mark.integration

# this module's pipeline (one per broker) and the per-test check that it is healthy
pipe, _healthy = faults.pipe, faults._healthy


# -- crashes ---------------------------------------------------------------------------------
def _outcome(pipe, rel, scenario, ids, views, watch, t_fault, mem, n_prompts=1, recovery_s=None, **extra):
    """Count lost and duplicated jobs, check them, and add the row to the reliability table."""
    started, done = pipe.ledger()
    completed = [j for j in ids if views[j]["status"] == "succeeded"]
    # every job reached a terminal state (wait_all); one that did not succeed was lost to the fault
    lost = len(ids) - len(completed)
    dup_results = watch.duplicated(ids)
    rids = request_ids(ids, n_prompts)
    engine_reruns = [r for r in rids if done.get(r, 0) > 1]
    last = max(v["_seen_at"] for v in views.values())
    row = {
        "scenario": scenario, "sent": len(ids), "completed": len(completed), "lost": lost,
        "duplicated": len(dup_results), "result_publishes_gt1": len(watch.published_twice(ids)),
        "engine_reruns": len(engine_reruns), "requests_redelivered": sum(1 for r in rids if started.get(r, 0) > 1),
        "recovery_s": round(recovery_s if recovery_s is not None else last - t_fault, 2),
        "all_done_after_fault_s": round(last - t_fault, 2),
        "peak_rss_mb": mem.total_peak_mb, "redis_peak_mb": round(mem.redis_used_peak, 1), **extra,
    }
    rel.record(row)
    assert lost == 0, {j: views[j]["status"] for j in ids if views[j]["status"] != "succeeded"}
    assert not dup_results, dup_results
    return row


def _submit_many(pipe, n, text="Tell me a story about"):
    return [pipe.submit(body(i, text)) for i in range(n)]


@pytest.mark.slow
@pytest.mark.each_broker
def test_kill9_inference_mid_batch_then_a_new_worker_finishes_every_job(pipe, rel):
    pipe.reset_ledger()
    watch = rel.ResultWatch(pipe.s.redis_url)
    pipe.set_delay("batch", 1.0)
    try:
        with rel.MemSampler(pipe) as mem:
            ids = _submit_many(pipe, 30, "kill inference")
            rel.wait_until(lambda: len(pipe.ledger()[0]) >= 8, 30, what="a batch in the engine")
            time.sleep(0.3)  # the batch sleeps 1 s in the engine: kill it mid-batch
            lease = pipe.lease("inference")
            t_kill = pipe.kill("inference")
            assert pipe.wait_exit("inference", 10) == -signal.SIGKILL
            pipe.clear_delays()
            pipe.respawn("inference", wait=False)  # what a supervisor (systemd, k8s) does
            # swept: the messages the dead worker held are back in the queue (one script)
            rel.wait_until(lambda: pipe.swept(lease), rel.RECOVERY_S + 30, what="redelivery")
            redelivered_s = time.time() - t_kill
            views = pipe.wait_all(ids, timeout=120)
    finally:
        watch.close()
    row = _outcome(pipe, rel, "kill -9 inference worker mid-batch", ids, views, watch, t_kill, mem,
                   redelivered_after_s=round(redelivered_s, 2), lease_ttl_s=rel.LEASE_TTL_S,
                   lease_sweep_interval_s=rel.LEASE_SWEEP_S)
    # the dead worker's messages came back within lease_ttl + sweep interval, swept by the
    # other stages' workers while the new inference worker still loads its engine
    assert redelivered_s <= rel.RECOVERY_S + rel.SLACK_S, row
    assert row["requests_redelivered"] >= 1  # it really was mid-batch
    assert row["engine_reruns"] == 0, row  # nothing finished in the engine twice


def _kill_prefork_worker(pipe, rel, kind, task, scenario):
    pipe.reset_ledger()
    watch = rel.ResultWatch(pipe.s.redis_url)
    pipe.set_delay(task, 0.4)
    try:
        with rel.MemSampler(pipe) as mem:
            ids = _submit_many(pipe, 12, f"kill {kind}")
            lease = pipe.lease(kind)
            # a task running (each sleeps 0.4 s first); on a busy machine the jobs may take
            # longer than any fixed sleep to reach postprocess
            held = rel.wait_until(lambda: pipe.held_count(lease), 60, every=0.2, what=f"{kind} holding a task")
            t_kill = pipe.kill(kind)  # the process group: main process and pool child
            pipe.wait_exit(kind, 10)
            pipe.clear_delays()
            pipe.respawn(kind, wait=False)
            rel.wait_until(lambda: pipe.swept(lease), rel.RECOVERY_S + 30, what="redelivery")
            redelivered_s = time.time() - t_kill
            views = pipe.wait_all(ids, timeout=120)
    finally:
        watch.close()
    row = _outcome(pipe, rel, scenario, ids, views, watch, t_kill, mem, redelivered_after_s=round(redelivered_s, 2),
                   messages_held=held)
    assert redelivered_s <= rel.RECOVERY_S + rel.SLACK_S, row
    assert held >= 1, row  # it really held a message when killed
    assert row["engine_reruns"] == 0, row
    return row


@pytest.mark.slow
@pytest.mark.each_broker
def test_kill9_preprocess_worker_mid_task(pipe, rel):
    _kill_prefork_worker(pipe, rel, "preprocess", "llmpipe.preprocess", "kill -9 preprocess worker mid-task")


@pytest.mark.slow
@pytest.mark.each_broker
def test_kill9_postprocess_worker_mid_task(pipe, rel):
    _kill_prefork_worker(pipe, rel, "postprocess", "llmpipe.postprocess", "kill -9 postprocess worker mid-task")


@pytest.mark.slow
def test_kill9_prefork_child_alone_is_replaced_and_its_task_requeued(pipe, rel):
    pipe.reset_ledger()
    watch = rel.ResultWatch(pipe.s.redis_url)
    pipe.set_delay("llmpipe.postprocess", 1.0)
    main = pipe.pid("postprocess")
    try:
        with rel.MemSampler(pipe) as mem:
            ids = _submit_many(pipe, 6, "kill child")
            rel.wait_until(lambda: len(pipe.ledger()[1]) >= 1, 30, what="a request past the engine")
            time.sleep(0.5)  # the child sleeps 1 s in the postprocess task
            [child] = pipe.pool_pids("postprocess")
            t_kill = time.time()
            os.kill(child, signal.SIGKILL)
            pipe.clear_delays()
            rel.wait_until(lambda: pipe.unacked_before(t_kill, "postprocess") == 0, rel.RECOVERY_S + 30,
                           what="the requeue")
            requeued_s = time.time() - t_kill
            rel.wait_until(lambda: pipe.pool_pids("postprocess") and pipe.pool_pids("postprocess") != [child], 30,
                           what="a new pool child")
            views = pipe.wait_all(ids, timeout=60)
    finally:
        watch.close()
    assert pipe.pid("postprocess") == main and pipe.alive("postprocess")
    row = _outcome(pipe, rel, "kill -9 one prefork child (postprocess)", ids, views, watch, t_kill, mem,
                   requeued_after_s=round(requeued_s, 2))
    # requeued by the parent at once (task_reject_on_worker_lost); the parent lives, so its
    # lease never expires and no sweep was involved
    assert requeued_s < rel.LEASE_TTL_S, row


@pytest.mark.slow
def test_sigterm_inference_finishes_running_work_loses_and_reruns_nothing(pipe, rel):
    pipe.reset_ledger()
    watch = rel.ResultWatch(pipe.s.redis_url)
    pipe.set_delay("batch", 1.0)
    try:
        with rel.MemSampler(pipe) as mem:
            ids = _submit_many(pipe, 30, "sigterm")
            rel.wait_until(lambda: len(pipe.ledger()[0]) >= 8, 30, what="a batch in the engine")
            t_term = pipe.kill("inference", signal.SIGTERM, group=False)
            code = pipe.wait_exit("inference", 60)
            stopped_s = time.time() - t_term
            pipe.clear_delays()
            pipe.respawn("inference", wait=False)
            views = pipe.wait_all(ids, timeout=120)
    finally:
        watch.close()
    started, done = pipe.ledger()
    row = _outcome(pipe, rel, "SIGTERM (warm shutdown) inference worker", ids, views, watch, t_term, mem,
                   warm_stop_s=round(stopped_s, 2), exit_code=code)
    assert code == 0
    assert row["requests_redelivered"] == 0 and row["engine_reruns"] == 0, row  # re-ran nothing
    assert all(started.get(r) == 1 for r in request_ids(ids)), started


@pytest.mark.slow
@pytest.mark.each_broker
def test_engine_death_exits_nonzero_and_requeues_its_requests_at_once(pipe, rel):
    pipe.reset_ledger()
    watch = rel.ResultWatch(pipe.s.redis_url)
    pipe.set_delay("batch", 0.5)
    try:
        with rel.MemSampler(pipe) as mem:
            ids = _submit_many(pipe, 10, "engine death")
            pipe.expect_death("inference")
            time.sleep(0.2)
            ids.append(pipe.submit(body(99, "ENGINEDIE here")))
            code = pipe.wait_exit("inference", 60)
            t_dead = time.time()
            # requeued by the dying worker itself, not after the visibility timeout
            try:
                rel.wait_until(lambda: pipe.unacked_before(t_dead) == 0, 3, what="the dead worker's messages requeued")
            except AssertionError:
                left = [json.loads(v) for v in pipe.r.hvals("unacked")]
                raise AssertionError([(m[0]["headers"]["task"], m[0]["properties"]["delivery_tag"]) for m in left])
            requeued_s = time.time() - t_dead
            pipe.clear_delays()
            pipe.respawn("inference", wait=False)
            views = pipe.wait_all(ids, timeout=120)
    finally:
        watch.close()
    log = pipe.log("inference")
    assert code == 70, log[-3000:]
    assert "engine died" in log and "requeued" in log
    _outcome(pipe, rel, "engine dies (EngineDeadError) in a batch", ids, views, watch, t_dead, mem,
             exit_code=code, requeued_after_s=round(requeued_s, 2))


@pytest.mark.slow
def test_request_that_kills_every_worker_is_dead_lettered_after_max_deliveries(pipe, rel):
    t0 = time.time()
    job = pipe.submit(body(0, "KILLSEVERYWORKER"))
    crashes = 0
    for _ in range(pipe.s.max_deliveries):
        assert pipe.wait_exit("inference", 60) == 70
        crashes += 1
        pipe.respawn("inference", wait=False)  # as a supervisor would, each time
    view = pipe.wait_all([job], timeout=90)[job]
    assert view["status"] == "failed", view
    err = view["result"]["results"][0]["error"]
    assert err["reason"] == "engine_error" and "delivered" in err["message"], err
    pipe.wait_worker("inference", 60)  # and the last worker stays up
    dl = [json.loads(m) for m in pipe.r.zrange("llmpipe:deadletter", 0, -1)]
    assert any(e.get("job_id") == job and e["reason"] == "max_deliveries" for e in dl)
    terminal = ("succeeded", "failed", "expired", "cancelled")
    rel.record({"scenario": "a request that kills every worker (poison pill)", "sent": 1,
                "completed": int(view["status"] == "succeeded"), "lost": int(view["status"] not in terminal),
                "failed": int(view["status"] == "failed"), "worker_crashes": crashes,
                "recovery_s": round(view["_seen_at"] - t0, 2), "note": "dead-lettered after max_deliveries=3"})


@pytest.mark.slow
def test_job_whose_worker_never_comes_back_is_expired_by_the_watchdog(pipe, rel):
    t0 = time.time()
    pipe.kill("inference")
    pipe.wait_exit("inference", 10)
    ids = [pipe.submit(body(i, "orphan", timeout=4)) for i in range(3)]
    views = pipe.wait_all(ids, timeout=30)
    for j in ids:
        v = views[j]
        assert v["status"] == "expired", v
        assert v["error"]["type"] == "expired"
        # settled within grace + one watchdog round (+ slack) after the deadline
        assert v["_seen_at"] - v["deadline"] <= pipe.s.watchdog_grace_s + pipe.s.watchdog_interval_s + 2.5, v
    dl = [json.loads(m) for m in pipe.r.zrange("llmpipe:deadletter", 0, -1)]
    assert {e.get("job_id") for e in dl if e["reason"] == "expired"} >= set(ids)
    # a worker that comes back later runs the stale messages to no effect: still expired
    pipe.respawn("inference")
    # drained and acked: the worker has run (and skipped) every stale message
    rel.wait_until(lambda: pipe.r.llen("inference") == 0 and pipe.r.hlen("unacked") == 0, 30,
                   what="the stale messages run and acked")
    assert all(pipe.view(j)["status"] == "expired" for j in ids)
    final = [pipe.view(j)["status"] for j in ids]
    rel.record({"scenario": "worker dies, never comes back (watchdog)", "sent": len(ids),
                "completed": final.count("succeeded"), "lost": sum(1 for st in final if st not in ("succeeded", "failed",
                "expired", "cancelled")), "expired": final.count("expired"),
                "recovery_s": round(max(views[j]["_seen_at"] - views[j]["deadline"] for j in ids), 2),
                "note": "settled 'expired' after deadline", "wall_s": round(time.time() - t0, 1)})


@pytest.mark.slow
def test_a_stalled_inference_worker_past_its_lease_gives_no_job_a_second_result(pipe, rel):
    """SIGSTOP the inference worker mid-batch for longer than its lease (a long pause, a
    partition): a live worker sweeps its messages back, a second inference worker runs every
    job, then SIGCONT. The stalled worker finishes its batch late; its results lose to the
    stored ones (StageMemo's first write wins), its acks are ignored (its lease no longer
    holds the messages), and no job record or job result changes."""
    from llmpipe.broker.leases import LEASES_KEY

    pipe.reset_ledger()
    watch = rel.ResultWatch(pipe.s.redis_url)
    pipe.set_delay("batch", 1.0)
    stalled = pipe.child("inference")
    pid = stalled.proc.pid
    try:
        with rel.MemSampler(pipe) as mem:
            ids = _submit_many(pipe, 12, "stall")
            rel.wait_until(lambda: len(pipe.ledger()[0]) >= 8, 30, what="a batch in the engine")
            time.sleep(0.3)  # the batch sleeps 1 s in the engine: stop it mid-batch
            [lease] = [x.decode() for x in pipe.r.zrange(LEASES_KEY, 0, -1) if x.decode().split(":")[1] == str(pid)]
            t_stop = pipe.kill("inference", signal.SIGSTOP)
            started, done = pipe.ledger()
            in_engine = set(started) - set(done)  # a first batch may have ended before the stop
            held = pipe.held_count(lease)
            pipe.clear_delays()
            argv = list(stalled.argv)
            argv[argv.index("-n") + 1] = f"inference-b-{pipe.s.api_port}@llmpipe"
            pipe.lp.sup.spawn("inference", argv, stalled.env)  # a second worker takes over
            rel.wait_until(lambda: pipe.r.zscore(LEASES_KEY, lease) is None, rel.RECOVERY_S + 30, what="the sweep")
            swept_s = time.time() - t_stop
            views = pipe.wait_all(ids, timeout=120)
            records = {j: pipe.r.hgetall(f"llmpipe:job:{j}") for j in ids}

            t_cont = time.time()
            os.killpg(pid, signal.SIGCONT)
            # it wakes: it finds its lease lost, ends what it ran and had reserved (the stored
            # results win), and its acks count for nothing
            rel.wait_until(lambda: f"lease {lease} was lost" in pipe.log("inference"), 30, what="the lease loss noticed")
            rel.wait_until(lambda: pipe.log("inference").count(f"ignored: lease {lease} ") >= held, 60,
                           what=f"its {held} late acks")
            rel.wait_until(pipe.queues_idle, 60, what="the late duplicates drained")
            after = {j: pipe.r.hgetall(f"llmpipe:job:{j}") for j in ids}
    finally:
        watch.close()
        os.killpg(pid, signal.SIGCONT)
    stalled.proc.terminate()  # back to one inference worker for the next tests
    stalled.proc.wait(60)
    row = _outcome(pipe, rel, "SIGSTOP inference worker past its lease, second worker, SIGCONT", ids, views,
                   watch, t_stop, mem, swept_after_s=round(swept_s, 2), messages_held=held,
                   stalled_in_engine=len(in_engine), resumed_after_s=round(t_cont - t_stop, 2))
    assert swept_s <= rel.RECOVERY_S + rel.SLACK_S, row
    assert row["requests_redelivered"] >= len(in_engine), row  # the second worker ran the stalled batch again
    assert watch.published_twice(ids) == [], row  # one result per job, stored once
    assert after == records  # no job record moved, not even its updated_at
