"""How a worker process wires prefix-aware routing (workers/context.py): the router's block
size, no routing at all when the setting is off, and what an inference worker's membership
reports."""

from __future__ import annotations

from types import SimpleNamespace

from llmpipe.jobs.lanes import Lane, queue_keys
from llmpipe.routing.keys import BACKLOG_KEY
from llmpipe.settings import Settings
from llmpipe.stages import worker_queue
from tests.harness.waiting import wait_until
from workers.context import WorkerContext
from workers.route_member import _amqp_depth, start_member


def test_the_router_hashes_by_the_setting_else_the_engine_argument_else_the_workers_report():
    assert WorkerContext(Settings(route_block_size=64)).router.block_size == 64
    # an engine argument arrives as typed on the command line
    assert WorkerContext(Settings(engine_args={"block_size": "32"})).router.block_size == 32
    assert WorkerContext(Settings()).router.block_size is None  # the workers report it


def test_preprocess_routes_only_while_routing_is_on(redis_url):
    on = WorkerContext(Settings(redis_url=redis_url)).preprocess_stage
    off = WorkerContext(Settings(redis_url=redis_url, prefix_routing=False)).preprocess_stage
    assert on.route is not None and off.route is None



def test_an_inference_workers_membership_reports_its_models_interactive_backlog(redis_client, redis_url):
    s = Settings(redis_url=redis_url)
    shared = s.served.default.queue
    redis_client.lpush(queue_keys(shared, Lane.INTERACTIVE)[0], "i1", "i2")
    redis_client.lpush(queue_keys(shared, Lane.BATCH)[-1], "b1")  # the batch lane's backlog holds nothing back
    member = start_member(SimpleNamespace(block_size=128), redis_client, s, worker_queue(shared, "inference-1@h"), 8)
    try:
        wait_until(lambda: redis_client.hget(BACKLOG_KEY, shared) == b"2", timeout=10, what="the backlog reported")
    finally:
        member.leave()


def test_on_rabbitmq_each_count_asks_for_both_queues_so_one_broker_read_serves_a_report():
    asked = []

    class Depths:  # AmqpDepths' interface; the real one answers from its cache for 0.25 s
        def sample(self, queues):
            asked.append(frozenset(queues))
            return SimpleNamespace(depths={"inference~w@h": 1, "inference": 5})

    depths = Depths()
    own, waiting = _amqp_depth(depths, "inference~w@h", "inference"), _amqp_depth(depths, "inference", "inference~w@h")
    assert (own(), waiting()) == (1, 5)
    assert set(asked) == {frozenset({"inference~w@h", "inference"})}
