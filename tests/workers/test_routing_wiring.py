"""How a worker process wires prefix-aware routing (workers/context.py): the router's block
size, and no routing at all when the setting is off."""

from __future__ import annotations

from llmpipe.settings import Settings
from workers.context import WorkerContext


def test_the_router_hashes_by_the_setting_else_the_engine_argument_else_the_workers_report():
    assert WorkerContext(Settings(route_block_size=64)).router.block_size == 64
    # an engine argument arrives as typed on the command line
    assert WorkerContext(Settings(engine_args={"block_size": "32"})).router.block_size == 32
    assert WorkerContext(Settings()).router.block_size is None  # the workers report it


def test_preprocess_routes_only_while_routing_is_on(redis_url):
    on = WorkerContext(Settings(redis_url=redis_url)).preprocess_stage
    off = WorkerContext(Settings(redis_url=redis_url, prefix_routing=False)).preprocess_stage
    assert on.route is not None and off.route is None
