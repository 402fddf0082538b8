"""Leases, claims, acks and the sweep (llmpipe/broker/leases.py) on a real Redis, with the time
passed in (the scripts' injectable clock) instead of slept."""

from __future__ import annotations

import json
import uuid

import pytest

from llmpipe.broker.leases import HOLDER_KEY, LEASES_KEY, LeaseKeeper, LeaseStore, lease_tags_key, wake_key

TTL = 4.0


def message(queue: str, text: str, tag: str | None = None) -> dict:
    """A kombu message as the Redis transport stores it (what Celery publishes)."""
    return {"body": text, "content-encoding": "utf-8", "content-type": "application/json",
            "headers": {"task": "t", "id": text, "args": [], "kwargs": {}},
            "properties": {"delivery_tag": tag or str(uuid.uuid4()), "priority": 0, "body_encoding": "base64",
                           "delivery_info": {"exchange": "", "routing_key": queue}}}


def push(r, queue: str, *texts: str) -> list[dict]:
    msgs = [message(queue, t) for t in texts]
    for m in msgs:
        r.lpush(queue, json.dumps(m))
        r.lpush(wake_key(queue), "1")
    return msgs


def keys(*queues: str) -> list[tuple[str, str]]:
    return [(q, q) for q in queues]


def queue_texts(r, queue: str) -> list[str]:
    """The queue from its front (the next message a consumer takes) to its back."""
    return [json.loads(m)["body"] for m in reversed(r.lrange(queue, 0, -1))]


@pytest.fixture
def store(redis_client):
    return LeaseStore(redis_client)


def test_a_claim_moves_the_message_into_unacked_and_the_lease_in_one_step(store, redis_client):
    r = redis_client
    store.create("A", TTL, now=100.0)
    [m1, m2] = push(r, "q", "one", "two")
    c = store.claim("A", keys("q"), now=101.0)
    assert c.status == "ok" and c.key == "q" and c.more
    assert json.loads(c.payload)["body"] == "one"
    tag = m1["properties"]["delivery_tag"]
    # kombu's unacked entry: [message, exchange, routing key], readable by kombu's restore
    assert json.loads(r.hget("unacked", tag)) == [m1, "", "q"]
    assert r.zscore("unacked_index", tag) == 101.0
    assert store.holder(tag) == "A"
    assert r.hexists(lease_tags_key("A"), tag)
    assert queue_texts(r, "q") == ["two"]
    c2 = store.claim("A", keys("q"), now=101.5)
    assert c2.status == "ok" and not c2.more
    assert store.claim("A", keys("q"), now=101.6).status == "empty"
    assert not r.exists(wake_key("q"))  # the queue is empty: its tokens were stale


def test_a_claim_takes_from_the_keys_in_the_order_given(store, redis_client):
    store.create("A", TTL, now=0.0)
    push(redis_client, "a", "from a")
    push(redis_client, "b", "from b")
    c = store.claim("A", keys("b", "a"), now=1.0)
    assert json.loads(c.payload)["body"] == "from b"


def test_an_expired_or_swept_lease_claims_nothing(store, redis_client):
    store.create("A", TTL, now=100.0)
    push(redis_client, "q", "one")
    assert store.claim("A", keys("q"), now=104.5).status == "expired"
    assert store.claim("nobody", keys("q"), now=100.0).status == "lost"
    assert queue_texts(redis_client, "q") == ["one"]  # left where it was


def test_renewal_pushes_the_expiry_out_and_reports_a_swept_lease_as_lost(store, redis_client):
    store.create("A", TTL, now=100.0)
    store.create("B", TTL, now=100.0)
    assert store.renew(["A"], TTL, now=103.0) == []
    assert redis_client.zscore(LEASES_KEY, "A") == 107.0
    assert [x for x, _ in store.sweep(now=105.0)] == ["B"]
    assert store.renew(["A", "B"], TTL, now=105.0) == ["B"]
    # an expired lease that nobody swept yet revives: nobody took its messages
    assert store.renew(["A"], TTL, now=108.0) == [] and redis_client.zscore(LEASES_KEY, "A") == 112.0


def test_the_sweep_restores_exactly_the_dead_leases_messages_to_the_front(store, redis_client):
    r = redis_client
    store.create("dead", TTL, now=100.0)
    store.create("live", TTL, now=100.0)
    push(r, "q", "d1", "d2", "l1", "x1", "x2")
    d1 = store.claim("dead", keys("q"), now=100.1)
    d2 = store.claim("dead", keys("q"), now=100.2)
    l1 = store.claim("live", keys("q"), now=100.3)
    assert queue_texts(r, "q") == ["x1", "x2"]
    # a message a plain kombu consumer holds (no lease): left to the visibility timeout
    r.hset("unacked", "plain", json.dumps([message("q", "p"), "", "q"]))
    r.zadd("unacked_index", {"plain": 90.0})
    r.delete(wake_key("q"))
    store.renew(["live"], TTL, now=103.0)

    assert store.sweep(now=104.5) == [("dead", 2)]

    # the dead lease's two, oldest delivery frontmost, then the queue as it was
    assert queue_texts(r, "q") == ["d1", "d2", "x1", "x2"]
    assert r.llen(wake_key("q")) == 2  # one token per restored message
    dead_tags = [json.loads(c.payload)["properties"]["delivery_tag"] for c in (d1, d2)]
    live_tag = json.loads(l1.payload)["properties"]["delivery_tag"]
    for t in dead_tags:
        assert not r.hexists("unacked", t) and r.zscore("unacked_index", t) is None and store.holder(t) is None
    assert r.hexists("unacked", live_tag) and store.holder(live_tag) == "live"
    assert r.hexists("unacked", "plain") and r.zscore("unacked_index", "plain") == 90.0
    assert not r.exists(lease_tags_key("dead")) and not store.is_live("dead") and store.is_live("live")
    assert store.sweep(now=104.6) == []


def test_the_sweep_restores_a_priority_message_to_its_own_key_with_a_token_for_its_queue(store, redis_client):
    r = redis_client
    pri_key = "q\x06\x163"
    store.create("dead", TTL, now=0.0)
    r.lpush(pri_key, json.dumps(message("q", "urgent")))
    assert store.claim("dead", [(pri_key, "q")], now=0.5).key == pri_key
    assert store.sweep(now=10.0) == [("dead", 1)]
    assert json.loads(r.lindex(pri_key, -1))["body"] == "urgent" and r.llen(wake_key("q")) == 1


def test_a_late_ack_cannot_forget_the_new_delivery_of_a_restored_message(store, redis_client):
    r = redis_client
    store.create("stalled", TTL, now=100.0)
    push(r, "q", "job")
    tag = json.loads(store.claim("stalled", keys("q"), now=100.1).payload)["properties"]["delivery_tag"]
    assert store.sweep(now=105.0) == [("stalled", 1)]
    store.create("other", TTL, now=105.0)
    assert store.claim("other", keys("q"), now=105.1).status == "ok"  # same tag, new holder
    assert store.ack(tag, "stalled") is False  # the stalled worker wakes and acks
    assert r.hexists("unacked", tag) and store.holder(tag) == "other"
    assert store.ack(tag, "other") is True
    assert not r.hexists("unacked", tag) and store.holder(tag) is None and not r.hexists(lease_tags_key("other"), tag)


def test_release_gives_back_everything_the_lease_holds(store, redis_client):
    store.create("A", TTL, now=None)
    push(redis_client, "q", "one", "two")
    store.claim("A", keys("q"))
    store.claim("A", keys("q"))
    assert store.release("A") == 2
    assert queue_texts(redis_client, "q") == ["one", "two"]
    assert not store.is_live("A") and redis_client.hlen("unacked") == 0 and redis_client.hlen(HOLDER_KEY) == 0


def test_a_message_without_a_delivery_tag_is_handed_over_untracked(store, redis_client):
    store.create("A", TTL, now=0.0)
    redis_client.lpush("q", "not json")
    c = store.claim("A", keys("q"), now=0.1)
    assert c.status == "raw" and c.payload == b"not json" and redis_client.hlen("unacked") == 0


def test_the_keeper_renews_its_leases_sweeps_dead_ones_and_reports_lost_ones(store, redis_client):
    lost, swept = [], []
    keeper = LeaseKeeper(store, TTL, 1.0, on_lost=lost.append, on_swept=lambda i, n: swept.append((i, n)),
                         clock=lambda: 50.0)
    store.create("mine", TTL)
    store.create("gone", TTL)
    store.create("dead", -1.0)  # expired already (server time)
    keeper.hold("mine")
    keeper.hold("gone")
    redis_client.zrem(LEASES_KEY, "gone")  # as if swept while this process was stopped
    keeper.tick()
    assert lost == ["gone"] and swept == [("dead", 0)] and keeper.last_renewed == 50.0
    assert store.is_live("mine")
    keeper.tick()
    assert lost == ["gone"]  # reported once, then no longer renewed


def test_a_queue_consumed_without_acks_is_popped_untracked(store, redis_client):
    store.create("A", TTL, now=0.0)
    push(redis_client, "replies", "r1")
    c = store.claim("A", [("replies", "replies", False)], now=0.1)
    assert c.status == "raw" and json.loads(c.payload)["body"] == "r1"
    assert redis_client.hlen("unacked") == 0 and redis_client.hlen(HOLDER_KEY) == 0
