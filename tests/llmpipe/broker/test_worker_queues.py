"""A single worker's own queue on the Redis broker (llmpipe/broker/worker_queues.py): the lease
sweep hands what a dead worker held, and what waited in its queue, to the shared queue; a
live worker keeps its queue. On a real Redis, with the time passed in."""

from __future__ import annotations

import json
import uuid

import pytest

from llmpipe.broker.leases import LeaseKeeper, LeaseStore, wake_key
from llmpipe.broker.worker_queues import FORGET_AFTER_S, OWNERS_KEY, Drainer, amqp_arguments, declaration
from llmpipe.jobs.lanes import PRIORITY_SEP
from llmpipe.routing.keys import MEMBERS_KEY
from llmpipe.stages import worker_queue

TTL = 4.0
SHARED = "inference"
OWN = worker_queue(SHARED, "inference-1-8000@llmpipe")


def message(queue: str, text: str) -> dict:
    return {"body": text, "content-encoding": "utf-8", "content-type": "application/json",
            "headers": {"task": "t", "id": text, "args": [], "kwargs": {}},
            "properties": {"delivery_tag": str(uuid.uuid4()), "priority": 0, "body_encoding": "base64",
                           "delivery_info": {"exchange": queue, "routing_key": queue}}}


def push(r, key: str, *texts: str) -> None:
    """Publish as the transport does: LPUSH, the next message to claim is the rightmost."""
    for t in texts:
        r.lpush(key, json.dumps(message(key.split(PRIORITY_SEP)[0], t)))


def texts(r, key: str) -> list[str]:
    """From the front (the next claimed) to the back."""
    return [json.loads(m)["body"] for m in reversed(r.lrange(key, 0, -1))]


@pytest.fixture
def store(redis_client):
    return LeaseStore(redis_client)


@pytest.fixture
def drainer(redis_client):
    return Drainer(redis_client)


def test_a_dead_leases_worker_queue_goes_to_the_front_of_the_shared_queue_in_order(store, drainer, redis_client):
    r = redis_client
    store.create("w1", TTL, now=100.0)
    drainer.own([OWN], "w1")
    push(r, OWN, "o1", "o2")
    push(r, OWN + PRIORITY_SEP + "9", "batch")
    push(r, SHARED, "s1")
    assert drainer.drain(now=103.0) == []  # live: its queue is its own
    assert texts(r, OWN) == ["o1", "o2"]

    assert drainer.drain(now=104.5) == [(OWN, 3)]  # expired, not even swept yet

    assert texts(r, SHARED) == ["o1", "o2", "s1"] and texts(r, SHARED + PRIORITY_SEP + "9") == ["batch"]
    assert not r.exists(OWN) and r.llen(wake_key(SHARED)) == 3
    assert r.hget(OWNERS_KEY, OWN) == b"w1"  # kept: the lease is not swept yet


def test_the_entry_is_forgotten_once_swept_empty_and_unrouted_for_a_while(store, drainer, redis_client):
    r = redis_client
    store.create("w1", TTL, now=100.0)
    drainer.own([OWN], "w1")
    r.zadd(MEMBERS_KEY, {OWN: 104.0})  # its routing membership, as its last report left it
    store.sweep(now=104.5)
    assert drainer.drain(now=104.5) == [] and r.hget(OWNERS_KEY, OWN) == b"w1"  # kept a while
    push(r, OWN, "late")  # routed in the membership's last moment, published a moment later
    assert drainer.drain(now=104.6) == [(OWN, 1)] and texts(r, SHARED) == ["late"]
    assert drainer.drain(now=104.0 + FORGET_AFTER_S - 1) == [] and r.hexists(OWNERS_KEY, OWN)
    assert drainer.drain(now=104.0 + FORGET_AFTER_S + 1) == []
    assert not r.hexists(OWNERS_KEY, OWN)


def test_a_restarted_worker_keeps_the_queue_its_dead_predecessor_consumed(store, drainer, redis_client):
    r = redis_client
    store.create("old", TTL, now=100.0)
    drainer.own([OWN], "old")
    store.create("new", TTL, now=102.0)  # the same node, restarted
    drainer.own([OWN], "new")
    push(r, OWN, "for the new one")
    store.sweep(now=104.5)
    assert drainer.drain(now=104.5) == [] and texts(r, OWN) == ["for the new one"]


def test_the_sweep_gives_what_a_dead_worker_claimed_from_its_own_queue_to_the_shared_queue(store, redis_client):
    r = redis_client
    store.create("w1", TTL, now=100.0)
    push(r, OWN, "held")
    push(r, OWN + PRIORITY_SEP + "9", "held batch")
    push(r, SHARED, "queued")
    own_keys = [(OWN, OWN), (OWN + PRIORITY_SEP + "9", OWN)]
    assert store.claim("w1", own_keys, now=100.1).status == "ok"
    assert store.claim("w1", own_keys, now=100.2).status == "ok"
    assert store.sweep(now=104.5) == [("w1", 2)]
    assert texts(r, SHARED) == ["held", "queued"] and texts(r, SHARED + PRIORITY_SEP + "9") == ["held batch"]
    assert not r.exists(OWN) and r.llen(wake_key(SHARED)) == 2 and not r.exists(wake_key(OWN))


def test_the_lease_keeper_drains_after_each_sweep(store, drainer, redis_client):
    r = redis_client
    store.create("dead", TTL, now=0.0)  # long expired by Redis server time
    drainer.own([OWN], "dead")
    push(r, OWN, "waiting")
    LeaseKeeper(store, TTL, 1.0, drain=drainer.drain).tick()
    assert texts(r, SHARED) == ["waiting"]


def test_a_worker_queue_is_declared_with_its_dead_letter_route_on_rabbitmq(monkeypatch):
    from llmpipe.settings import Settings

    args = amqp_arguments(OWN, 5.0)
    assert args["x-message-ttl"] == 5000 and args["x-queue-type"] == "quorum"
    assert args["x-dead-letter-exchange"] == SHARED and args["x-dead-letter-routing-key"] == SHARED
    assert args["x-dead-letter-strategy"] == "at-least-once" and args["x-overflow"] == "reject-publish"
    amqp = Settings(broker_url="amqp://guest@h//", lease_ttl_s=4, lease_sweep_interval_s=1.5)
    monkeypatch.setattr("llmpipe.broker.worker_queues.get_settings", lambda: amqp)
    q = declaration(OWN)
    assert q.exchange.type == "topic" and q.queue_arguments == amqp_arguments(OWN, 1.5)
    monkeypatch.setattr("llmpipe.broker.worker_queues.get_settings", lambda: Settings())
    assert declaration(OWN).queue_arguments is None  # Redis


def test_the_app_declares_worker_queues_by_their_own_rules():
    from llmpipe.celery_app import app

    assert app.amqp.queues[OWN].routing_key == OWN
    assert app.amqp.queues["some-queue"].name == "some-queue"  # Celery's own for any other
