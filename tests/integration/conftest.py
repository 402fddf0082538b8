"""Real pipelines for integration tests: real Redis, real Celery worker processes, a real
engine on the tiny model, the API under uvicorn, and Flower (tests/harness/stacks.py).
``pipeline`` and ``secured_pipeline`` are shared stacks (tests/harness/shared.py): the
modules that use the same engine and broker borrow one pipeline in turn."""

from __future__ import annotations

import pytest
import redis

from llmpipe.testing import faulty
from tests.harness.brokers import TEST_BROKERS
from tests.harness.celery_cli import PlainCelery
from tests.harness.faults import API_FAULTS
from tests.harness.shared import lends
from tests.harness.stacks import pipeline_key, start_pipeline, teardown
from tests.harness.vllm_pair import PAIR_KEY, Pair


@pytest.fixture(scope="session")
def pipeline_starter():
    """tests.harness.stacks.start_pipeline, as a fixture."""
    return start_pipeline


# (engine, broker): both engines on Redis, and vLLM on RabbitMQ too; the brokers as in
# LLMPIPE_TEST_BROKERS.
PIPELINES = [p for p in (("vllm", "redis"), ("transformers", "redis"), ("vllm", "rabbitmq")) if p[1] in TEST_BROKERS]


@pytest.fixture(scope="module", params=PIPELINES, ids=lambda p: p[0] if p[1] == "redis" else "-".join(p))
@lends(lambda params: pipeline_key(*params["pipeline"]))
def pipeline(request, borrow):
    """The shared pipeline of each (engine, broker), on the shipped API settings."""
    engine, broker = request.param
    return borrow(engine, broker_url=request.getfixturevalue("rabbitmq_url") if broker == "rabbitmq" else None)


@pytest.fixture(scope="module")
@lends(lambda params: PAIR_KEY)
def servers(shared_stacks, tmp_path_factory, tiny_model):
    """(llmpipe URL, vllm serve URL) of the shared pair (tests/harness/vllm_pair.py), started
    once for the conformance modules."""
    return shared_stacks.get(PAIR_KEY, lambda: Pair(tmp_path_factory.mktemp("conformance"), tiny_model),
                             Pair.close).servers


API_KEY = "test-key-1"


@pytest.fixture(scope="module")
@lends(lambda params: pipeline_key("vllm", "redis"))
def secured_pipeline(borrow):
    """The shared vLLM pipeline on Redis, its API behind API keys."""
    return borrow("vllm", api_keys=f"{API_KEY},other-key")


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
