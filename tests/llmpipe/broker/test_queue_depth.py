"""Queue depths on both brokers, admission with depths given by the caller (RabbitMQ), and
the Celery configuration that LLMPIPE_BROKER_URL selects."""

import json
import os
import subprocess
import sys

import pytest

from llmpipe.broker.queue_depth import AmqpDepths, RedisDepths, depth_reader, is_amqp
from llmpipe.jobs.admission import Admission
from tests.harness.clock import ManualClock


def test_is_amqp_reads_the_scheme():
    assert is_amqp("amqp://guest:guest@127.0.0.1:5672//") and is_amqp("amqps://h/v") and is_amqp("pyamqp://h//")
    assert not is_amqp("redis://127.0.0.1:6379/0") and not is_amqp("rediss://h:1/0")


def test_redis_depths_are_the_list_lengths(redis_client):
    redis_client.rpush("inference", *[b"m"] * 3)
    sample = RedisDepths(redis_client, clock=ManualClock(5.0)).sample(("preprocess", "inference"))
    assert sample.depths == {"preprocess": 0, "inference": 3} and sample.taken_at == 5.0


@pytest.fixture
def amqp(rabbitmq_url):
    from kombu import Connection, Queue

    names = ("qd-a", "qd-b")
    # confirms: a publish returns once the message is in its queue
    with Connection(rabbitmq_url, transport_options={"confirm_publish": True}) as c:
        ch = c.channel()
        for n in names:
            Queue(n, queue_arguments={"x-queue-type": "quorum"})(ch).declare()
        yield c, names
        for n in names:
            c.channel().queue_delete(n)


def test_amqp_depths_count_ready_messages_and_cache_them(amqp, rabbitmq_url):
    conn, (a, b) = amqp
    producer = conn.Producer()
    for _ in range(3):
        producer.publish({"x": 1}, routing_key=a)
    clock = ManualClock()
    depths = AmqpDepths(rabbitmq_url, max_age_s=0.25, clock=clock)
    try:
        first = depths.sample((a, b, "qd-never-declared"))
        assert first.depths == {a: 3, b: 0, "qd-never-declared": 0} and first.taken_at == clock.t
        producer.publish({"x": 1}, routing_key=b)
        clock.t += 0.1  # within max_age: the cached counts
        assert depths.sample((a, b)).depths == {a: 3, b: 0}
        clock.t += 0.2  # past it: read again (the channel survived the missing queue's 404)
        again = depths.sample((a, b))
        assert again.depths == {a: 3, b: 1} and again.taken_at == clock.t
    finally:
        depths.close()


def test_amqp_depths_raise_when_the_broker_is_away_and_recover():
    from llmpipe.local.redis_server import free_port

    depths = AmqpDepths(f"amqp://guest:guest@127.0.0.1:{free_port()}//", connect_timeout_s=0.5, max_age_s=0)
    with pytest.raises(Exception):  # noqa: B017 - whatever kombu raises: the caller maps it (503, no depth)
        depths.sample(("preprocess",))
    assert depth_reader("redis://x:1/0", r=object()).__class__ is RedisDepths


class Given:
    """Depths as RabbitMQ would report them, sampled at ``taken_at``."""

    def __init__(self, depths, taken_at, now=None):
        self.depths, self.taken_at = depths, taken_at
        self.now = now  # a fresh count: (depths, taken_at), else the same sample again
        self.fresh_asked = 0

    def sample(self, queues, fresh=False):
        from llmpipe.broker.queue_depth import DepthSample

        if fresh:
            self.fresh_asked += 1
            if self.now is not None:
                self.depths, self.taken_at = self.now
        return DepthSample({q: self.depths.get(q, 0) for q in queues}, self.taken_at)


def test_admission_on_given_depths_names_the_full_stage(redis_client):
    clock = ManualClock()
    a = Admission(redis_client, max_queue_depth=3, max_queued_tokens=0, clock=clock,
                  depths=Given({"inference": 3}, taken_at=clock.t))
    d = a.try_admit("j1", 10, deadline=2000)
    assert not d.admitted and d.stage == "inference" and d.depth == 3
    # the Redis list of the same name is not what counts on RabbitMQ
    redis_client.rpush("postprocess", *[b"m"] * 5)
    a.depths = Given({}, taken_at=clock.t)
    assert a.try_admit("j2", 10, deadline=2000).admitted


def test_jobs_published_after_the_sample_count_until_a_newer_sample(redis_client):
    clock = ManualClock()
    given = Given({"preprocess": 1}, taken_at=clock.t - 0.1)
    a = Admission(redis_client, max_queue_depth=3, max_queued_tokens=0, clock=clock, depths=given)
    for j in ("j1", "j2"):
        assert a.try_admit(j, 1, 2000).admitted
        a.published(j)  # in RabbitMQ now, but not in the sample taken before
    d = a.try_admit("j3", 1, 2000)
    assert not d.admitted and d.stage == "preprocess" and d.depth == 3
    given.depths, given.taken_at = {"preprocess": 1}, clock.t + 0.01  # a newer sample: they were consumed
    clock.t += 0.02
    assert a.try_admit("j3", 1, 2000).admitted
    clock.t += 11  # and the marks go after 10 s
    a.try_admit("j4", 1, 2000)
    assert redis_client.zcard("llmpipe:admission:recent") <= 1


def test_a_refusal_on_a_cached_sample_is_checked_against_a_fresh_one(redis_client):
    clock = ManualClock()
    # cached: 1 queued, then 2 published since; the broker now counts 0 (workers took them)
    given = Given({"preprocess": 1}, taken_at=clock.t - 0.01, now=({"preprocess": 0}, clock.t + 0.001))
    a = Admission(redis_client, max_queue_depth=3, max_queued_tokens=0, clock=clock, depths=given)
    for j in ("j1", "j2"):
        assert a.try_admit(j, 1, 2000).admitted
        a.published(j)
    assert given.fresh_asked == 0  # admitted on the cached sample: no broker round trip
    clock.t += 0.002
    assert a.try_admit("j3", 1, 2000).admitted  # 1 + 2 = 3 on the cache; 0 on the fresh count
    assert given.fresh_asked == 1


CONF = ("import json, celeryconfig as c; print(json.dumps({'url': c.broker_url, 'opts': c.broker_transport_options, "
        "'type': getattr(c, 'task_default_queue_type', None), 'detect': getattr(c, 'worker_detect_quorum_queues', None), "
        "'queues': [[q.name, q.queue_arguments, q.exchange.type] for q in c.task_queues]}))")


def _conf(**env) -> dict:
    full = {k: v for k, v in os.environ.items() if k != "LLMPIPE_BROKER_URL"}
    full.update(LLMPIPE_CONFIG="", **env)
    out = subprocess.run([sys.executable, "-c", CONF], env=full, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_broker_url_selects_rabbitmq_with_quorum_queues_and_confirms():
    amqp = _conf(LLMPIPE_BROKER_URL="amqp://guest:guest@127.0.0.1:5672//", LLMPIPE_REDIS_URL="redis://127.0.0.1:1/0")
    assert amqp["url"].startswith("amqp://") and amqp["opts"] == {"confirm_publish": True}
    assert amqp["type"] == "quorum" and amqp["detect"] is True
    assert {q[0] for q in amqp["queues"]} == {"preprocess", "inference", "postprocess", "collect"}
    # no x-max-priority: quorum queues refuse it; topic exchanges: native delayed delivery needs them
    assert all(q[1] == {"x-queue-type": "quorum"} and q[2] == "topic" for q in amqp["queues"])
    redis = _conf(LLMPIPE_REDIS_URL="redis://127.0.0.1:1/0")
    assert redis["url"] == "redis://127.0.0.1:1/0" and "visibility_timeout" in redis["opts"]
    # the shipped lanes reach every consumer (llmpipe/jobs/lanes.py BatchClaims)
    assert (redis["opts"]["lane_batch_slot_share"], redis["opts"]["lane_slot_hold_s"]) == (0.03125, 30.0)
    assert redis["opts"]["lane_interactive_reserve"] == 0.0625
    assert redis["type"] is None and all(not q[1] for q in redis["queues"])
