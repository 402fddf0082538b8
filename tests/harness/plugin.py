"""The tests' pytest plugin (loaded by tests/conftest.py): the session's Redis, the tiny
models, the brokers, the each_broker rule, the shared stacks' lifetimes and the reliability
table. Stacks: tests/harness/stacks.py and shared.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import redis

from llmpipe.local.redis_server import EmbeddedRedis
from tests.deploy.prebuild import ControllerPlugin
from tests.harness import rows
from tests.harness.brokers import AMQP_URL, TEST_BROKERS, check_rabbitmq, delete_vhost, make_vhost, reset_broker_queues
from tests.harness.distribute import distribute
from tests.harness.shared import POOL, last_users
from tests.harness.stacks import borrow_pipeline

MODEL_CACHE = Path(os.environ.get("LLMPIPE_TEST_CACHE", Path.home() / ".cache" / "llmpipe-test"))


def pytest_configure(config):
    """The scheduler of the xdist groups (tests/harness/xdist_groups.py), where pytest-xdist
    runs (a dev dependency; ``-p no:xdist`` turns it off); in its controller, the Compose
    run's engine and images made from the run's start (tests/deploy/prebuild.py)."""
    if config.pluginmanager.hasplugin("xdist"):
        from tests.harness import xdist_groups  # it imports xdist itself

        config.pluginmanager.register(xdist_groups, "llmpipe-xdist-groups")
        if xdist_groups.controlling(config):
            config.pluginmanager.register(ControllerPlugin(), "llmpipe-compose-prebuild")


# -- the session's Redis and models ----------------------------------------------------------
@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A redis-server of the session's own (no AOF), for tests that need a Redis."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), appendonly=False).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture
def redis_client(redis_url):
    """A client of the session's Redis, emptied (flushdb) for this test."""
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    yield r
    r.close()


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from llmpipe.models.tiny import build_tiny

    return str(build_tiny(MODEL_CACHE / "tiny"))


@pytest.fixture(scope="session")
def tiny_model_b() -> str:
    """A second tiny model: the same shape and tokenizer, other weights (seed 1), so that
    two served models answer the same prompt differently."""
    from llmpipe.models.tiny import build_tiny

    return str(build_tiny(MODEL_CACHE / "tiny-seed1", seed=1))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


# -- brokers (tests/harness/brokers.py) ------------------------------------------------------
@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups off the items
def pytest_collection_modifyitems(config, items):
    """A test on a broker-parametrized pipeline runs on RabbitMQ only when marked each_broker;
    then the groups of tests that one worker runs together, in hand-out order
    (tests/harness/distribute.py)."""
    _each_broker(config, items)
    distribute(items)


def _each_broker(config, items):
    keep, drop = [], []
    for item in items:
        cs = getattr(item, "callspec", None)
        on_other = cs is not None and cs.params.get("broker", "redis") != "redis"
        (drop if on_other and item.get_closest_marker("each_broker") is None else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def rabbitmq_url():
    """An AMQP URL on a vhost of this session's own (made with rabbitmqctl, deleted at the
    end); without rabbitmqctl, LLMPIPE_TEST_AMQP_URL as given (point it at a spare vhost)."""
    check_rabbitmq()
    vhost = f"llmpipe-test-{os.getpid()}"
    url = make_vhost(vhost)
    yield url or AMQP_URL
    if url:
        delete_vhost(vhost)


@pytest.fixture(scope="module", params=TEST_BROKERS)
def broker(request) -> str:
    """The broker kind of a broker-parametrized pipeline: "redis" or "rabbitmq"."""
    return request.param


@pytest.fixture(scope="module")
def broker_url(request, broker) -> str | None:
    """None: the pipeline's Redis is its broker (the default); else RabbitMQ's URL, its
    stage queues emptied."""
    if broker == "redis":
        return None
    if broker != "rabbitmq":
        raise ValueError(f"unknown broker {broker!r} in LLMPIPE_TEST_BROKERS (redis, rabbitmq)")
    url = request.getfixturevalue("rabbitmq_url")
    reset_broker_queues(url)
    return url


# -- shared stacks (tests/harness/shared.py) -------------------------------------------------
def pytest_collection_finish(session):
    POOL.last = last_users(session.items)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    POOL.done_with(item.nodeid)


@pytest.fixture(scope="session")
def shared_stacks():
    """The session's pool of shared stacks (tests/harness/shared.py); stops what is left at the end."""
    yield POOL
    POOL.close()


@pytest.fixture(scope="session")
def borrow(shared_stacks, tmp_path_factory, tiny_model):
    """``borrow(engine, broker_url=None, **api_settings)``: the shared pipeline of that engine
    and broker on the tiny model, reset and lent to the calling module (stacks.borrow_pipeline).
    Its fixture is marked ``@lends(lambda params: pipeline_key(engine, broker))``."""
    def lend(engine: str, *, broker_url: str | None = None, **api_settings):
        return borrow_pipeline(shared_stacks, tmp_path_factory, tiny_model, engine, broker_url=broker_url,
                               **api_settings)

    return lend


# -- the reliability table (tests/harness/rows.py) -------------------------------------------
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    rows.running(item)
    yield
    rows.running(None)


def pytest_runtest_logreport(report):
    rows.gather(report)


def pytest_terminal_summary(terminalreporter):
    rows.summary(terminalreporter)
