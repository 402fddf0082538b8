"""Real pipelines for integration tests: real Redis, real Celery worker processes, a real
engine on the tiny model, the API under uvicorn, and Flower (tests/harness/stacks.py)."""

from __future__ import annotations

import pytest
import redis

from llmpipe.testing import faulty
from tests.harness.brokers import TEST_BROKERS, reset_broker_queues
from tests.harness.celery_cli import PlainCelery
from tests.harness.faults import API_FAULTS
from tests.harness.stacks import start_pipeline, teardown


@pytest.fixture(scope="session")
def pipeline_starter():
    """tests.harness.stacks.start_pipeline, as a fixture."""
    return start_pipeline


# (engine, broker): both engines on Redis, and vLLM on RabbitMQ too; the brokers as in
# LLMPIPE_TEST_BROKERS.
PIPELINES = [p for p in (("vllm", "redis"), ("transformers", "redis"), ("vllm", "rabbitmq")) if p[1] in TEST_BROKERS]


@pytest.fixture(scope="module", params=PIPELINES, ids=lambda p: p[0] if p[1] == "redis" else "-".join(p))
def pipeline(request, tmp_path_factory, redis_server, tiny_model):
    engine, broker = request.param
    broker_url = None
    if broker == "rabbitmq":
        broker_url = request.getfixturevalue("rabbitmq_url")
        reset_broker_queues(broker_url)
    redis.Redis.from_url(redis_server.url).flushdb()
    p = start_pipeline(tmp_path_factory.mktemp(f"pipe-{engine}-{broker}"), redis_server.url, tiny_model, engine,
                       broker_url=broker_url)
    yield p
    teardown(p)


API_KEY = "test-key-1"


@pytest.fixture(scope="module")
def secured_pipeline(tmp_path_factory, redis_server, tiny_model):
    """vLLM on the tiny model, behind API keys."""
    redis.Redis.from_url(redis_server.url).flushdb()
    p = start_pipeline(tmp_path_factory.mktemp("pipe-secured"), redis_server.url, tiny_model, "vllm",
                       api_keys=f"{API_KEY},other-key")
    yield p
    teardown(p)


@pytest.fixture(scope="session")
def plain_celery():
    """tests.harness.celery_cli.PlainCelery, as a fixture."""
    return PlainCelery


@pytest.fixture(scope="module")
def faulty_pipeline(tmp_path_factory, redis_server, tiny_model):
    """The transformers engine (one batch at a time) behind the fault injector; otherwise
    the shipped defaults."""
    redis.Redis.from_url(redis_server.url).flushdb()
    p = start_pipeline(tmp_path_factory.mktemp("pipe-faulty"), redis_server.url, tiny_model, "transformers",
                       flower=False, extra_env=faulty.env(API_FAULTS))
    yield p
    teardown(p)
