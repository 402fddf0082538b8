"""Priority lanes (llmpipe/jobs/lanes.py): the mapping, the per-lane admission budget (real
Redis), the batcher's order (fake clock) and the transport's claim order across the
priority lists (real Redis, kombu producers and consumers)."""

from __future__ import annotations

import threading
import time

from llmpipe.broker.queue_depth import RedisDepths
from llmpipe.jobs.admission import Admission
from llmpipe.jobs.lanes import (
    PRIORITY_STEPS,
    BatchClaims,
    Lane,
    broker_priority,
    interactive_reserve,
    lane_for,
    queue_keys,
)
from llmpipe.processors.batching import Batcher
from tests.harness.brokers import connect, drain
from tests.harness.clock import ManualClock


def test_priority_picks_the_lane_and_the_lane_its_broker_priority():
    assert lane_for(0, 1) is Lane.INTERACTIVE  # vLLM's default priority is interactive
    assert lane_for(-5, 1) is Lane.INTERACTIVE
    assert lane_for(1, 1) is Lane.BATCH and lane_for(500, 1) is Lane.BATCH
    assert lane_for(5, 10) is Lane.INTERACTIVE
    # on Redis the lower step is claimed first: interactive on the first list, batch on the last
    assert broker_priority(Lane.INTERACTIVE) == PRIORITY_STEPS[0]
    assert broker_priority(Lane.BATCH) == PRIORITY_STEPS[-1]
    # AMQP delivers the highest first
    assert broker_priority(Lane.INTERACTIVE, amqp=True) > broker_priority(Lane.BATCH, amqp=True)
    assert queue_keys("inference")[0] == "inference" and len(queue_keys("inference")) == len(PRIORITY_STEPS)


def test_the_batch_lane_gets_429_while_the_interactive_lane_is_still_admitted(redis_client):
    a = Admission(redis_client, max_queue_depth=10, max_queued_tokens=0, clock=ManualClock(), batch_share=0.5)
    # a batch backlog on the batch lane's list of the inference queue
    redis_client.rpush(queue_keys("inference")[-1], *[b"m"] * 5)
    d = a.try_admit("b1", 1, 2000, lane=Lane.BATCH)
    assert not d.admitted and d.stage == "inference" and d.depth == 5 and d.limit == 5
    assert a.try_admit("i1", 1, 2000, lane=Lane.INTERACTIVE).admitted
    # interactive requests fill the rest of the budget, then get 429 too: every list counts
    redis_client.rpush("inference", *[b"m"] * 5)
    d = a.try_admit("i2", 1, 2000, lane=Lane.INTERACTIVE)
    assert not d.admitted and d.depth == 10 and d.limit == 10


def test_the_batch_lane_has_its_share_of_the_token_budget(redis_client):
    a = Admission(redis_client, max_queue_depth=0, max_queued_tokens=100, clock=ManualClock(), batch_share=0.5)
    assert a.try_admit("b1", 40, 2000, lane=Lane.BATCH).admitted
    d = a.try_admit("b2", 20, 2000, lane=Lane.BATCH)
    assert not d.admitted and d.stage == "tokens" and d.limit == 50
    assert a.try_admit("i1", 60, 2000, lane=Lane.INTERACTIVE).admitted


def test_depths_count_every_priority_list(redis_client):
    redis_client.rpush("preprocess", b"a")
    redis_client.rpush(queue_keys("preprocess")[-1], b"b", b"c")
    assert RedisDepths(redis_client).sample(["preprocess", "inference"]).depths == {"preprocess": 3, "inference": 0}


def _wait(pred, timeout=5.0):
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.005)


def test_a_batch_takes_the_lowest_priorities_first_in_arrival_order_among_equals():
    clock = ManualClock(100.0)
    gate = threading.Event()
    seen: list[list[tuple[str, int]]] = []

    def run(items):
        seen.append(list(items))
        gate.wait(5)
        return items

    b = Batcher(run, window_s=10.0, max_size=3, company_expected=lambda: False, clock=clock, order=lambda x: x[1])
    b.submit(("first", 5))  # runs alone and holds the engine
    _wait(lambda: b.pending() == 0)
    arrivals = [("b1", 5), ("b2", 5), ("i1", 0), ("b3", 5), ("i2", 0)]
    futs = []
    for item in arrivals:
        clock.t += 0.001
        futs.append(b.submit(item))
    gate.set()
    for f in futs:
        f.result(5)
    b.stop()
    assert seen[1] == [("i1", 0), ("i2", 0), ("b1", 5)]  # interactive first, then the oldest batch item
    assert seen[2] == [("b2", 5), ("b3", 5)]


def test_the_transport_claims_the_interactive_list_before_a_batch_backlog(redis_url, redis_client):
    with connect(redis_url, priority_steps=list(PRIORITY_STEPS), queue_order_strategy="priority") as conn:
        from kombu import Producer, Queue

        p = Producer(conn.channel())
        for i in range(5):
            p.publish({"n": f"batch{i}"}, routing_key="lanes", serializer="json", declare=[Queue("lanes")],
                      priority=broker_priority(Lane.BATCH))
        p.publish({"n": "interactive"}, routing_key="lanes", serializer="json", declare=[Queue("lanes")],
                  priority=broker_priority(Lane.INTERACTIVE))
        assert redis_client.llen(queue_keys("lanes")[-1]) == 5 and redis_client.llen("lanes") == 1
        got = [body["n"] for body, _ in drain(conn, "lanes", 6)]
    assert got == ["interactive", *(f"batch{i}" for i in range(5))]


def test_batch_claims_keep_a_share_of_the_prefetch_free_while_interactive_messages_come():
    clock = ManualClock()
    gate = BatchClaims(share=0.5, hold_s=30.0, clock=clock)
    assert gate.open(held=8, prefetch=8)  # no interactive message yet: the whole prefetch
    gate.interactive_taken()
    assert gate.open(held=3, prefetch=8) and not gate.open(held=4, prefetch=8)
    assert gate.open(held=100, prefetch=0)  # no prefetch limit: no share of it either
    assert gate.open(held=0, prefetch=1)  # at least one slot: the lane never starves
    clock.t += 30.0
    assert gate.open(held=8, prefetch=8)  # the hold passed: a batch-only load takes it all
    assert BatchClaims(share=0.5, hold_s=0.0, clock=clock).open(held=8, prefetch=8)


def test_between_interactive_messages_the_batch_leaves_the_reserve_of_the_prefetch_free():
    clock = ManualClock()
    gate = BatchClaims(share=0.0625, hold_s=30.0, clock=clock, reserve=0.0625)
    assert gate.open(held=59, prefetch=64) and not gate.open(held=60, prefetch=64)  # 4 of 64 kept free
    assert gate.open(held=8, prefetch=8)  # a prefork CPU pool's few slots: 1/16 rounds down to none
    assert BatchClaims(share=0.5, hold_s=30.0, clock=clock, reserve=0.9).open(held=0, prefetch=1)  # never the last

    gate.interactive_taken()
    assert gate.open(held=3, prefetch=64) and not gate.open(held=4, prefetch=64)  # the share, as before
    clock.t += 30.0
    assert not gate.open(held=60, prefetch=64)
    assert interactive_reserve(0.0, 64) == 0 and interactive_reserve(0.5, 64) == 32 and interactive_reserve(0.9, 2) == 1


def test_a_consumer_at_its_batch_share_takes_only_interactive_messages_until_it_acks_one(redis_url, redis_client):
    from kombu import Consumer, Producer, Queue

    got: list = []
    with connect(redis_url, priority_steps=list(PRIORITY_STEPS), queue_order_strategy="priority",
                 lane_batch_slot_share=0.5, lane_slot_hold_s=30.0) as conn:
        p = Producer(conn.channel())

        def send(name: str, lane: Lane) -> None:
            p.publish({"n": name}, routing_key="lanes", serializer="json", declare=[Queue("lanes")],
                      priority=broker_priority(lane))

        def take(n: int, until=None) -> None:
            end = time.monotonic() + 10
            want = len(got) + n
            while not (until() if until else len(got) >= want) and time.monotonic() < end:
                try:
                    conn.drain_events(timeout=0.5)
                except TimeoutError:
                    pass

        ch = conn.channel()
        ch.basic_qos(0, 4, False)  # a worker of four threads
        with Consumer(ch, [Queue("lanes")], callbacks=[lambda b, m: got.append((b["n"], m))], accept=["json"]):
            send("i0", Lane.INTERACTIVE)
            for i in range(6):
                send(f"b{i}", Lane.BATCH)
            take(3)  # the interactive message, then batch ones up to half of the prefetch
            assert [n for n, _ in got] == ["i0", "b0", "b1"]
            # the consumer claims again and finds no list it may take from: it waits on its tokens
            take(0, until=lambda: ch._batch_gated and ch._waiting)
            assert len(got) == 3  # the batch backlog waits: the fourth slot is the next interactive message's
            send("i1", Lane.INTERACTIVE)
            take(1)
            assert got[-1][0] == "i1"
            got[1][1].ack()  # a batch message done: its slot takes the next one
            take(1)
            assert got[-1][0] == "b2" and redis_client.llen(queue_keys("lanes")[-1]) == 3


def test_with_no_interactive_message_yet_the_reserve_stays_free_for_the_first_one(redis_url, redis_client):
    # A batch backlog and a consumer that has taken no interactive message (the hold has not
    # begun): it leaves the reserve of its prefetch to the first interactive message.
    from kombu import Consumer, Producer, Queue

    got: list = []
    with connect(redis_url, priority_steps=list(PRIORITY_STEPS), queue_order_strategy="priority",
                 lane_batch_slot_share=0.25, lane_slot_hold_s=30.0, lane_interactive_reserve=0.25) as conn:
        p = Producer(conn.channel())

        def send(name: str, lane: Lane) -> None:
            p.publish({"n": name}, routing_key="lanes", serializer="json", declare=[Queue("lanes")],
                      priority=broker_priority(lane))

        def take(until) -> None:
            end = time.monotonic() + 10
            while not until() and time.monotonic() < end:
                try:
                    conn.drain_events(timeout=0.5)
                except TimeoutError:
                    pass

        for i in range(6):
            send(f"b{i}", Lane.BATCH)
        ch = conn.channel()
        ch.basic_qos(0, 4, False)  # four threads, one of them the reserve
        with Consumer(ch, [Queue("lanes")], callbacks=[lambda b, m: got.append(b["n"])], accept=["json"]):
            take(lambda: len(got) >= 3 and ch._batch_gated and ch._waiting)
            assert got == ["b0", "b1", "b2"]  # the fourth slot stays free
            send("i0", Lane.INTERACTIVE)
            take(lambda: len(got) == 4)
            assert got[-1] == "i0" and redis_client.llen(queue_keys("lanes")[-1]) == 3


def test_acking_a_batch_message_at_the_share_wakes_the_consumer_for_the_next_one(redis_url, redis_client):
    # Without the wake the consumer, its batch claims held back, sleeps on its token lists until
    # the next message: under a steady stream of interactive ones it would claim only those.
    from kombu import Consumer, Producer, Queue

    got: list = []
    with connect(redis_url, priority_steps=list(PRIORITY_STEPS), queue_order_strategy="priority",
                 lane_batch_slot_share=0.25, lane_slot_hold_s=30.0, polling_interval=20) as conn:
        p = Producer(conn.channel())
        for name, lane in (("i0", Lane.INTERACTIVE), ("b0", Lane.BATCH), ("b1", Lane.BATCH)):
            p.publish({"n": name}, routing_key="lanes", serializer="json", declare=[Queue("lanes")],
                      priority=broker_priority(lane))
        ch = conn.channel()
        ch.basic_qos(0, 4, False)  # one batch slot of four

        def take(until, timeout: float) -> float:
            t0 = time.monotonic()
            while not until() and time.monotonic() - t0 < timeout:
                try:
                    conn.drain_events(timeout=0.1)
                except TimeoutError:
                    pass
            return time.monotonic() - t0

        with Consumer(ch, [Queue("lanes")], callbacks=[lambda b, m: got.append((b["n"], m))], accept=["json"]):
            take(lambda: len(got) == 2, 10)
            take(lambda: ch._batch_gated and ch._waiting, 10)  # b1 waits: the consumer sleeps on its tokens
            assert [n for n, _ in got] == ["i0", "b0"]
            got[1][1].ack()
            took = take(lambda: len(got) == 3, 10)
    assert got[-1][0] == "b1"
    print(f"\nnext batch message claimed {1000 * took:.0f} ms after the ack")
    assert took < 10  # woken, not at the end of the token wait (polling_interval, 20 s here)
