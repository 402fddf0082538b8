"""Admission control against a real Redis, with a fake clock."""

import threading

from llmpipe.jobs.admission import Admission, DrainRate, estimate_tokens, release
from tests.harness.clock import ManualClock


def test_rejects_when_a_stage_queue_is_full_and_names_it(redis_client):
    a = Admission(redis_client, max_queue_depth=3, max_queued_tokens=0, clock=ManualClock())
    redis_client.rpush("inference", *[b"m"] * 3)
    d = a.try_admit("j1", 10, deadline=2000)
    assert not d.admitted and d.stage == "inference" and d.depth == 3 and d.limit == 3


def test_pending_admissions_count_toward_the_preprocess_queue(redis_client):
    a = Admission(redis_client, max_queue_depth=2, max_queued_tokens=0, clock=ManualClock())
    assert a.try_admit("j1", 1, 2000).admitted
    assert a.try_admit("j2", 1, 2000).admitted
    # neither is published yet: the third would overshoot
    d = a.try_admit("j3", 1, 2000)
    assert not d.admitted and d.stage == "preprocess"
    a.published("j1")
    assert a.try_admit("j3", 1, 2000).admitted


def test_concurrent_admissions_never_overshoot(redis_client):
    a = Admission(redis_client, max_queue_depth=0, max_queued_tokens=100, clock=ManualClock())
    results = []

    def go(i):
        results.append(a.try_admit(f"j{i}", 10, 2000).admitted)

    ts = [threading.Thread(target=go, args=(i,)) for i in range(40)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert results.count(True) == 10
    assert int(redis_client.get("llmpipe:admission:tokens")) == 100


def test_tokens_are_released_on_collect_and_at_the_deadline(redis_client):
    clock = ManualClock()
    a = Admission(redis_client, max_queue_depth=0, max_queued_tokens=100, clock=clock)
    assert a.try_admit("j1", 60, deadline=1010).admitted
    assert a.try_admit("j2", 40, deadline=5000).admitted
    assert not a.try_admit("j3", 1, deadline=5000).admitted
    assert release(redis_client, "j2")
    assert not release(redis_client, "j2")  # once only
    assert a.try_admit("j3", 40, deadline=5000).admitted
    assert not a.try_admit("j4", 1, deadline=5000).admitted
    clock.t = 1011  # j1 passed its deadline without being collected
    assert a.try_admit("j4", 60, deadline=5000).admitted


def test_retry_after_follows_the_drain_rate_and_the_backlog(redis_client):
    clock = ManualClock()
    drain = DrainRate(window_s=60, clock=clock)
    drain.add(0, now=0.0)
    drain.add(20, now=10.0)  # 2 jobs/s
    a = Admission(redis_client, max_queue_depth=5, max_queued_tokens=0, clock=clock, drain=drain)
    a.sample_drain = lambda: None  # keep the synthetic samples
    redis_client.rpush("preprocess", *[b"m"] * 6)
    small = a.try_admit("x", 1, 2000)
    redis_client.rpush("preprocess", *[b"m"] * 20)
    big = a.try_admit("y", 1, 2000)
    assert not small.admitted and not big.admitted
    assert small.retry_after_s == 1.0  # 2 over the limit at 2 jobs/s
    assert big.retry_after_s == 11.0  # 22 over the limit at 2 jobs/s
    drain.add(80, now=20.0)  # faster drain: 4 jobs/s over the window
    assert a.try_admit("z", 1, 2000).retry_after_s == 6.0


def test_estimate_tokens():
    assert estimate_tokens(["abcd" * 10, "ab"], max_tokens=5) == (10 + 5) + (1 + 5)
