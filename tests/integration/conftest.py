"""Real pipelines for integration tests: real Redis, real Celery worker processes, a real
engine on the tiny model, the API under uvicorn, and Flower."""

from __future__ import annotations

import pytest

from llmpipe.redis_server import free_port


def start_pipeline(tmp_path, redis_url, model, engine, *, flower=True, extra_env=None, **overrides):
    from llmpipe.local import LocalPipeline
    from llmpipe.settings import Settings

    s = Settings(
        redis_url=redis_url, model=model, engine=engine, state_dir=tmp_path, api_port=free_port(),
        flower_port=free_port(), cpu_workers=1, max_batch_size=16, batch_window_ms=50, kv_cache_gib=1,
        **overrides,
    )
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(extra_env or {})}
    p = LocalPipeline(s, flower=flower, extra_env=env).start()
    try:
        p.wait_ready(timeout=240)
    except Exception:
        p.stop(timeout=10)
        raise
    return p


@pytest.fixture(scope="module", params=["vllm", "transformers"])
def pipeline(request, tmp_path_factory, redis_server, tiny_model):
    import redis

    redis.Redis.from_url(redis_server.url).flushdb()
    p = start_pipeline(tmp_path_factory.mktemp(f"pipe-{request.param}"), redis_server.url, tiny_model, request.param)
    yield p
    p.stop(timeout=30)


API_KEY = "test-key-1"


@pytest.fixture(scope="module")
def secured_pipeline(tmp_path_factory, redis_server, tiny_model):
    """vLLM on the tiny model, behind API keys."""
    import redis

    redis.Redis.from_url(redis_server.url).flushdb()
    p = start_pipeline(tmp_path_factory.mktemp("pipe-secured"), redis_server.url, tiny_model, "vllm",
                       api_keys=f"{API_KEY},other-key")
    yield p
    p.stop(timeout=30)


# Markers the test-only fault injector reacts to (llmpipe/engines/faulty.py).
FAULTS = {"poison": "POISONPILL", "fail_after_tokens": {"LATEPOISON": 8}, "ledger": True}


@pytest.fixture(scope="module")
def faulty_pipeline(tmp_path_factory, redis_server, tiny_model):
    """The transformers engine (one batch at a time) behind the fault injector; otherwise
    the shipped defaults."""
    import json

    import redis

    redis.Redis.from_url(redis_server.url).flushdb()
    p = start_pipeline(tmp_path_factory.mktemp("pipe-faulty"), redis_server.url, tiny_model, "transformers",
                       flower=False, extra_env={"LLMPIPE_FAULT_INJECT": json.dumps(FAULTS)})
    yield p
    p.stop(timeout=30)
