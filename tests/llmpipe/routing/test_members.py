"""A worker's routing membership (llmpipe/routing/members.py) on a real Redis, time passed in."""

from __future__ import annotations

from llmpipe.jobs.lanes import Lane, queue_keys
from llmpipe.routing.keys import BACKLOG_KEY, INFO_KEY, LOAD_KEY, MEMBERS_KEY
from llmpipe.routing.members import RouteMember
from tests.harness.waiting import wait_until

Q = "inference~inference-1@host"


def test_a_report_renews_the_membership_and_sets_what_the_worker_holds_and_what_waits_for_it(redis_client):
    r = redis_client
    r.lpush(Q, "m1", "m2")  # two messages wait in its own queue (Redis broker)
    held = {"n": 3}
    m = RouteMember(r, Q, capacity=64, block_size=128, ttl_s=4.0, held=lambda: held["n"], queued=lambda: 1,
                    queue_keys=[Q, Q + "\x06\x169"])
    assert m.report(now=100.0) == 3 + 1 + 2
    assert r.zscore(MEMBERS_KEY, Q) == 104.0
    assert r.hget(INFO_KEY, Q) == b"64 128"
    r.hincrby(LOAD_KEY, Q, 5)  # routers' estimates between two reports
    held["n"] = 0
    assert m.report(now=100.25) == 3 and int(r.hget(LOAD_KEY, Q)) == 3 and r.zscore(MEMBERS_KEY, Q) == 104.25


def test_a_report_sets_its_models_backlog_to_the_interactive_requests_waiting_in_the_shared_queue(redis_client):
    r = redis_client
    interactive, batch = queue_keys("inference", Lane.INTERACTIVE), queue_keys("inference", Lane.BATCH)
    r.lpush(interactive[0], "i1", "i2")
    r.lpush(batch[-1], "b1")  # the batch lane waits by design: it holds no request back
    r.lpush(Q, "m1")  # its own queue's: the worker takes those itself
    m = RouteMember(r, Q, capacity=64, block_size=128, ttl_s=4.0, held=lambda: 0, queue_keys=[Q], shared="inference",
                    shared_keys=interactive)
    assert m.report(now=100.0) == 1
    assert int(r.hget(BACKLOG_KEY, "inference")) == 2
    # RabbitMQ counts the shared queue itself (the caller's count)
    m = RouteMember(r, Q, capacity=64, block_size=128, ttl_s=4.0, held=lambda: 0, shared="inference", waiting=lambda: 7)
    m.report(now=100.25)
    assert int(r.hget(BACKLOG_KEY, "inference")) == 7
    # a member that reports no shared queue leaves the backlog as it is
    RouteMember(r, Q, capacity=64, block_size=128, ttl_s=4.0, held=lambda: 0).report(now=100.5)
    assert int(r.hget(BACKLOG_KEY, "inference")) == 7


def test_leaving_removes_the_worker_at_once(redis_client):
    m = RouteMember(redis_client, Q, capacity=8, block_size=16, ttl_s=4.0, held=lambda: 0)
    m.report(now=100.0)
    m.leave(now=101.0)
    assert redis_client.zscore(MEMBERS_KEY, Q) == 101.0  # ended: no router takes it from 101.0 on
    assert not redis_client.hexists(LOAD_KEY, Q)
    assert not redis_client.hexists(INFO_KEY, Q)


def test_members_gone_long_ago_are_forgotten_by_any_report(redis_client):
    r = redis_client
    RouteMember(r, "inference~old@h", capacity=8, block_size=16, ttl_s=4.0, held=lambda: 0).report(now=100.0)
    RouteMember(r, "inference~recent@h", capacity=8, block_size=16, ttl_s=4.0, held=lambda: 0).report(now=3000.0)
    RouteMember(r, Q, capacity=8, block_size=16, ttl_s=4.0, held=lambda: 0, forget_after_s=3600).report(now=3710.0)
    assert r.zscore(MEMBERS_KEY, "inference~old@h") is None and not r.hexists(LOAD_KEY, "inference~old@h")
    assert r.zscore(MEMBERS_KEY, "inference~recent@h") is not None


def test_the_thread_reports_until_the_worker_leaves(redis_client):
    m = RouteMember(redis_client, Q, capacity=8, block_size=16, ttl_s=4.0, held=lambda: 2, every_s=0.02).start()
    wait_until(lambda: redis_client.hget(LOAD_KEY, Q) == b"2", 5, "a report")
    m.leave()
    assert not redis_client.hexists(LOAD_KEY, Q)
    assert redis_client.zscore(MEMBERS_KEY, Q) <= redis_client.time()[0] + 1
