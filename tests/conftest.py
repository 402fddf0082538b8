"""Shared fixtures: a Redis of the tests' own, the tiny model, and real pipelines."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# vLLM on CPU in tests: in-process engine core (fast start), a small KV cache, loopback.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
MODEL_CACHE = Path(os.environ.get("LLMPIPE_TEST_CACHE", Path.home() / ".cache" / "llmpipe-test"))


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    from llmpipe.redis_server import EmbeddedRedis

    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), appendonly=False).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture
def redis_client(redis_url):
    import redis

    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    yield r
    r.close()


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from llmpipe.models.tiny import build_tiny

    return str(build_tiny(MODEL_CACHE / "tiny"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)
