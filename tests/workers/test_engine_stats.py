"""The engine's figures a worker exports (workers/inference_runtime.py sample_engine)."""

from types import SimpleNamespace

from prometheus_client import REGISTRY

from workers.inference_runtime import sample_engine


def test_a_worker_that_served_nothing_exports_its_prefix_cache_counters_at_zero():
    # a stopped batcher: sample_engine only sets up its series and returns
    proc = SimpleNamespace(batcher=SimpleNamespace(running=False))
    labels = {"model": "m-idle", "worker": "inference-2-1@host"}
    assert REGISTRY.get_sample_value("llmpipe_engine_prefix_cache_queries_total", labels) is None
    sample_engine(proc, "m-idle", "inference-2-1@host")
    assert REGISTRY.get_sample_value("llmpipe_engine_prefix_cache_queries_total", labels) == 0.0
    assert REGISTRY.get_sample_value("llmpipe_engine_prefix_cache_hits_total", labels) == 0.0
