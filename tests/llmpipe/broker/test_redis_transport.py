"""The lease-aware kombu transport (llmpipe/broker/redis_transport.py) on a real Redis: kombu
producers and consumers, no Celery."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from queue import Empty

import pytest
from kombu import Connection, Consumer, Producer, Queue

from llmpipe.broker.leases import HOLDER_KEY, LEASES_KEY, wake_key
from tests.harness.brokers import connect, drain, publish
from tests.harness.waiting import wait_until


def test_messages_flow_with_a_lease_and_an_ack_clears_every_record(redis_url, redis_client):
    publish(redis_url, "q", {"n": 1}, {"n": 2})
    assert redis_client.llen(wake_key("q")) == 2  # one wake token per message
    with connect(redis_url) as conn:
        got = drain(conn, "q", 2)
        assert [b["n"] for b, _ in got] == [1, 2]
        [lease] = [x.decode() for x in redis_client.zrange(LEASES_KEY, 0, -1)]
        assert lease.split(":")[1] == str(os.getpid())
    assert redis_client.hlen("unacked") == 0 and redis_client.zcard("unacked_index") == 0
    assert redis_client.hlen(HOLDER_KEY) == 0
    assert redis_client.zcard(LEASES_KEY) == 0  # released at close


def test_an_idle_consumer_wakes_on_a_token_at_once(redis_url, redis_client):
    with connect(redis_url) as conn:
        got = []
        with Consumer(conn.channel(), [Queue("q")], callbacks=[lambda b, m: (got.append(time.monotonic()), m.ack())]):
            for _ in range(3):  # the consumer finds the queue empty and waits on its token list
                try:
                    conn.drain_events(timeout=0.3)
                except TimeoutError:
                    pass
            t0 = time.monotonic()
            publish(redis_url, "q", {"n": 1})
            while not got and time.monotonic() - t0 < 5:
                try:
                    conn.drain_events(timeout=0.5)
                except TimeoutError:
                    pass
    assert got
    print(f"\nwake latency {1000 * (got[0] - t0):.1f} ms")
    assert got[0] - t0 < 0.9  # not the 1 s wait timeout


def test_a_woken_consumer_reads_its_token_and_its_message_in_one_reply(redis_url, redis_client):
    """The claim goes out pipelined behind the wait, so the read that brings the token brings
    the message: no second round trip, no second turn of the event loop."""
    with connect(redis_url) as conn:
        ch = conn.channel()
        got, reads = [], []
        with Consumer(ch, [Queue("q")], callbacks=[lambda b, m: (got.append(b), m.ack())]):
            for _ in range(3):  # the consumer finds the queue empty and waits on its token list
                try:
                    conn.drain_events(timeout=0.3)
                except TimeoutError:
                    pass
            assert ch._waiting
            read = ch.handlers["BRPOP"]

            def counted(**kw):  # (what was sent, whether its reply delivered)
                kind = ch._sent[0]
                try:
                    reads.append((kind, read(**kw)))
                except Empty:
                    reads.append((kind, False))
                    raise

            ch.handlers["BRPOP"] = counted
            publish(redis_url, "q", {"n": 1})
            t0 = time.monotonic()
            while not got and time.monotonic() - t0 < 5:
                try:
                    conn.drain_events(timeout=0.5)
                except TimeoutError:
                    pass
    assert got == [{"n": 1}]
    # The wake's own reply delivered (before: ("wait", False), then ("claim", True)). A wait
    # that timed out just before the publish may come first, as ("wait+claim", False).
    assert reads[-1] == ("wait+claim", True) and all(r == ("wait+claim", False) for r in reads[:-1]), reads


def test_a_message_from_a_producer_without_tokens_is_still_consumed(redis_url, redis_client):
    with Connection(redis_url) as plain:  # kombu's own transport: no wake token
        Producer(plain.channel()).publish({"n": 7}, routing_key="q", serializer="json", declare=[Queue("q")])
    assert not redis_client.exists(wake_key("q"))
    with connect(redis_url) as conn:
        assert [b["n"] for b, _ in drain(conn, "q", 1)] == [7]


def test_a_live_lease_blocks_the_visibility_timeout(redis_url, redis_client):
    """A channel built with a 1 s visibility timeout (the shipped default is max_timeout_s
    + 60, never shortened) holds a message for longer than that: kombu's restore leaves it
    alone while the lease lives, and restores a message that no lease holds."""
    publish(redis_url, "q", {"n": 1})
    with connect(redis_url, visibility_timeout=1, unacked_restore_throttle=1) as conn:
        [(body, msg)] = drain(conn, "q", 1, ack=False)
        tag = msg.delivery_tag
        # a message held by no lease (claimed by a plain kombu consumer), as old
        redis_client.hset("unacked", "plain", json.dumps([{"body": "x", "headers": {}, "properties": {
            "delivery_tag": "plain", "delivery_info": {"exchange": "", "routing_key": "q"}}}, "", "q"]))
        old = time.time() - 100
        redis_client.zadd("unacked_index", {tag: old, "plain": old})
        msg.channel.qos.restore_visible(num=10, interval=1)
        assert redis_client.hexists("unacked", tag) and redis_client.llen("q") == 1  # only "plain" went back
        assert not redis_client.hexists("unacked", "plain")
        msg.ack()
    assert redis_client.hlen("unacked") == 0


def test_a_late_ack_or_reject_of_a_swept_message_changes_nothing(redis_url, redis_client):
    publish(redis_url, "q", {"n": 1})
    with connect(redis_url) as stalled, connect(redis_url) as other:
        [(_, msg)] = drain(stalled, "q", 1, ack=False)
        ch = msg.channel
        lease = ch._lease_id
        ch._keeper.stop()  # stalled: no renewals
        redis_client.zadd(LEASES_KEY, {lease: 1.0})  # and its lease ran out
        [(_, msg2)] = drain(other, "q", 1, ack=False)  # the other consumer swept it back and took it
        assert msg2.delivery_tag == msg.delivery_tag
        assert redis_client.hget(HOLDER_KEY, msg.delivery_tag).decode() == msg2.channel._lease_id
        msg.ack()  # the stalled one wakes: its ack must not forget the new delivery
        assert redis_client.hexists("unacked", msg.delivery_tag)
        ch.qos.restore_by_tag(msg.delivery_tag, leftmost=True)  # nor may its reject requeue a copy
        assert redis_client.llen("q") == 0
        msg2.ack()
    assert redis_client.hlen("unacked") == 0


CONSUMER = r"""
import sys, time
from kombu import Connection, Consumer, Queue
url, out = sys.argv[1], sys.argv[2]
with Connection(url, transport="llmpipe.broker.redis_transport:Transport") as conn:
    def on(body, msg):
        open(out, "a").write(str(body["n"]) + "\n")  # takes it and never acks
    with Consumer(conn.channel(), [Queue("q")], callbacks=[on], accept=["json"], prefetch_count=2):
        while True:
            try:
                conn.drain_events(timeout=1)
            except TimeoutError:
                pass
"""


def test_a_killed_consumers_messages_come_back_to_the_front_within_ttl_plus_sweep(redis_url, redis_client, tmp_path):
    """A consumer process holding messages is killed with SIGKILL; a live consumer in this
    process sweeps its lease and the messages are back at the front of the queue."""
    out = tmp_path / "taken"
    publish(redis_url, "q", *[{"n": i} for i in range(5)])
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-c", CONSUMER, redis_url, str(out)], env=env)
    try:
        wait_until(lambda: out.exists() and len(out.read_text().split()) >= 2, 20, "the consumer to take messages")
        taken = out.read_text().split()
    finally:
        proc.kill()
        proc.wait(10)
    t_kill = time.monotonic()
    held = redis_client.hlen("unacked")
    assert held == 2 and redis_client.llen("q") == 3
    with connect(redis_url, lease_ttl=4.0, lease_sweep_interval=1.0) as conn:
        ch = conn.channel()
        ch._ensure_lease()  # a live consumer: its keeper sweeps
        wait_until(lambda: redis_client.hlen("unacked") == 0, 10, "the dead consumer's messages back")
        back_s = time.monotonic() - t_kill
        front = [json.loads(base64.b64decode(json.loads(m)["body"]))["n"] for m in reversed(redis_client.lrange("q", 0, -1))]
        ch.close()
    print(f"\nkill -> {held} messages back in the queue: {back_s:.2f} s (lease_ttl 4 s + sweep 1 s)")
    assert sorted(front) == list(range(5))
    assert [str(n) for n in front[:len(taken)]] == taken  # the taken ones at the front, in order
    assert back_s <= 4.0 + 1.0 + 0.5


def test_a_no_ack_consumer_holds_nothing(redis_url, redis_client):
    """Celery's control replies are consumed without acks: kombu never acks them, so a
    claim must not record them as held (they would stay unacked while the lease lives)."""
    publish(redis_url, "replies", {"n": 1})
    with connect(redis_url) as conn:
        got = []
        with Consumer(conn.channel(), [Queue("replies")], callbacks=[lambda b, m: got.append(b)], no_ack=True):
            wait_until(lambda: conn.drain_events(timeout=1) or got, 10, "the reply")
        assert redis_client.hlen("unacked") == 0 and redis_client.hlen(HOLDER_KEY) == 0
