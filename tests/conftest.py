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
    from llmpipe.local.redis_server import EmbeddedRedis

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
def tiny_model_b() -> str:
    """A second tiny model: the same shape and tokenizer, other weights (seed 1), so that
    two served models answer the same prompt differently."""
    from llmpipe.models.tiny import build_tiny

    return str(build_tiny(MODEL_CACHE / "tiny-seed1", seed=1))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


# -- brokers (docs/reliability.md, "RabbitMQ") ---------------------------------------------
# The integration and reliability pipelines that exercise the broker run once per broker in
# LLMPIPE_TEST_BROKERS (default both). A test on such a pipeline runs on RabbitMQ only when
# it is marked ``each_broker``; the others (API shapes, fuzzing, Redis-list injection) run
# on Redis alone, so the second broker costs only the tests it can change.
TEST_BROKERS = [b.strip() for b in os.environ.get("LLMPIPE_TEST_BROKERS", "redis,rabbitmq").split(",") if b.strip()]
AMQP_URL = os.environ.get("LLMPIPE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
STAGE_QUEUES = ("preprocess", "inference", "postprocess", "collect")


def pytest_configure(config):
    config.addinivalue_line("markers", "each_broker: on a broker-parametrized pipeline, runs on every broker, not Redis alone")


def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    for item in items:
        cs = getattr(item, "callspec", None)
        on_other = cs is not None and cs.params.get("broker", "redis") != "redis"
        (drop if on_other and item.get_closest_marker("each_broker") is None else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def broker_unreachable(what: str):
    """In CI a broker that is not there fails the test; elsewhere it skips, with the reason."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{what} (CI=true: a missing broker fails, never skips)", pytrace=False)
    pytest.skip(what)


def _rabbitmqctl(*args: str) -> bool:
    import shutil
    import subprocess

    exe = shutil.which("rabbitmqctl")
    if exe is None:
        return False
    try:
        return subprocess.run([exe, "-q", *args], capture_output=True, timeout=60, stdin=subprocess.DEVNULL).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def rabbitmq_url():
    """An AMQP URL on a vhost of this session's own (made with rabbitmqctl, deleted at the
    end); without rabbitmqctl, LLMPIPE_TEST_AMQP_URL as given (point it at a spare vhost)."""
    from urllib.parse import quote

    from kombu import Connection

    try:
        with Connection(AMQP_URL, connect_timeout=3) as c:
            c.ensure_connection(max_retries=1)
    except Exception as exc:
        broker_unreachable(f"RabbitMQ at {AMQP_URL} is unreachable: {type(exc).__name__}: {exc}")
    vhost = f"llmpipe-test-{os.getpid()}"
    made = _rabbitmqctl("add_vhost", vhost) and _rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
    url = AMQP_URL.rstrip("/") + "/" + quote(vhost, safe="") if made else AMQP_URL
    yield url
    if made:
        _rabbitmqctl("delete_vhost", vhost)


def reset_broker_queues(url: str) -> None:
    """A fresh pipeline starts on empty stage queues (Redis: flushdb; RabbitMQ: delete them)."""
    from kombu import Connection

    with Connection(url, connect_timeout=3) as c:
        for q in STAGE_QUEUES:
            ch = c.channel()
            try:
                ch.queue_delete(q)
            except Exception:  # not declared yet
                pass
            finally:
                try:
                    ch.close()
                except Exception:
                    pass


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


@pytest.fixture(scope="session")
def reset_queues():
    """reset_broker_queues (other conftests cannot import this one)."""
    return reset_broker_queues
