"""The batch feeding lease (llmpipe/batches/lease.py) on a real Redis, with a fake clock."""

from __future__ import annotations

from llmpipe.batches.lease import BatchLeases, lease_key, owner_pid
from tests.harness.clock import ManualClock


def _pair(redis_client, clock, ttl=10.0):
    return (BatchLeases(redis_client, ttl_s=ttl, owner="host:1:a", clock=clock),
            BatchLeases(redis_client, ttl_s=ttl, owner="host:2:b", clock=clock))


def test_one_holder_at_a_time_until_it_lapses(redis_client):
    clock = ManualClock()
    a, b = _pair(redis_client, clock)
    assert a.acquire("b1").ok and a.acquire("b1").other is None  # taking it again is a renewal
    got = b.acquire("b1")
    assert not got.ok and got.other == "host:1:a"
    clock.t += 9.9
    assert not b.acquire("b1").ok and a.held("b1")
    clock.t += 0.2  # past a's expiry, nobody renewed
    assert not a.held("b1")
    got = b.acquire("b1")
    assert got.ok and got.other == "host:1:a" and b.holder("b1") == "host:2:b"


def test_renewal_keeps_it_and_reports_a_lost_one(redis_client):
    clock = ManualClock()
    a, b = _pair(redis_client, clock)
    a.acquire("b1")
    a.acquire("b2")
    for _ in range(5):
        clock.t += 5
        assert a.renew(["b1", "b2"]) == []
        assert not b.acquire("b1").ok
    clock.t += 11  # a stalled: b takes b2 over
    assert b.acquire("b2").ok
    assert a.renew(["b1", "b2"]) == ["b2"]  # b1 lapsed but nobody took it: a keeps it
    assert a.held("b1") and not a.held("b2") and b.held("b2")


def test_release_hands_it_on_at_once_and_only_by_its_holder(redis_client):
    clock = ManualClock()
    a, b = _pair(redis_client, clock)
    a.acquire("b1")
    assert not b.release("b1") and a.held("b1")
    assert a.release("b1")
    assert b.acquire("b1").ok and b.acquire("b1").other is None


def test_redis_time_without_a_clock(redis_client):
    a = BatchLeases(redis_client, ttl_s=30.0)
    assert a.acquire("b1").ok and a.held("b1")
    assert owner_pid(a.owner) is not None and redis_client.ttl(lease_key("b1")) > 0
