"""Real pipelines for integration tests: real Redis, real Celery worker processes, a real
engine on the tiny model, the API under uvicorn, and Flower."""

from __future__ import annotations

import os

import pytest

from llmpipe.local.redis_server import free_port
from llmpipe.testing import faulty
from tests.stacks import TEST_ENGINE, TEST_ENGINE_ENV, teardown


def start_pipeline(tmp_path, redis_url, model, engine, *, flower=True, extra_env=None, **overrides):
    from llmpipe.local.pipeline import LocalPipeline
    from llmpipe.settings import Settings

    s = Settings(
        redis_url=redis_url, model=model, engine=engine, state_dir=tmp_path, api_port=free_port(),
        flower_port=free_port(), cpu_workers=1, max_batch_size=16, batch_window_ms=50, kv_cache_gib=1,
        **{**TEST_ENGINE, **overrides},
    )
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(extra_env or {})}
    p = LocalPipeline(s, flower=flower, extra_env=env).start()
    try:
        p.wait_ready(timeout=240)
    except Exception:
        teardown(p, timeout=10)
        raise
    return p


@pytest.fixture(scope="session")
def pipeline_starter():
    """start_pipeline (test modules cannot import this conftest)."""
    return start_pipeline


# (engine, broker): both engines on Redis, and vLLM on RabbitMQ too; the brokers as in
# LLMPIPE_TEST_BROKERS (the root conftest's rule, read again: conftests cannot import it).
_BROKERS = [b.strip() for b in os.environ.get("LLMPIPE_TEST_BROKERS", "redis,rabbitmq").split(",") if b.strip()]
PIPELINES = [p for p in (("vllm", "redis"), ("transformers", "redis"), ("vllm", "rabbitmq")) if p[1] in _BROKERS]


@pytest.fixture(scope="module", params=PIPELINES, ids=lambda p: p[0] if p[1] == "redis" else "-".join(p))
def pipeline(request, tmp_path_factory, redis_server, tiny_model):
    import redis

    engine, broker = request.param
    broker_url = None
    if broker == "rabbitmq":
        broker_url = request.getfixturevalue("rabbitmq_url")
        request.getfixturevalue("reset_queues")(broker_url)
    redis.Redis.from_url(redis_server.url).flushdb()
    p = start_pipeline(tmp_path_factory.mktemp(f"pipe-{engine}-{broker}"), redis_server.url, tiny_model, engine,
                       broker_url=broker_url)
    yield p
    teardown(p)


API_KEY = "test-key-1"


@pytest.fixture(scope="module")
def secured_pipeline(tmp_path_factory, redis_server, tiny_model):
    """vLLM on the tiny model, behind API keys."""
    import redis

    redis.Redis.from_url(redis_server.url).flushdb()
    p = start_pipeline(tmp_path_factory.mktemp("pipe-secured"), redis_server.url, tiny_model, "vllm",
                       api_keys=f"{API_KEY},other-key")
    yield p
    teardown(p)


class PlainCelery:
    """Processes started as a Celery user would: ``celery -A tasks worker|flower|...`` with
    no LLMPIPE_WORKER_KIND and no pool, concurrency or node-name flags, plus ``llmpipe api``.
    Settings come from LLMPIPE_* variables; vLLM on the tiny model."""

    def __init__(self, tmp_path, redis_url: str, model: str, **settings: str):
        import os

        from celery import Celery

        from llmpipe.local.supervisor import Supervisor, python_env

        self.redis_url = redis_url
        self.api_port = free_port()
        self.flower_port = free_port()
        env = python_env({
            "LLMPIPE_REDIS_URL": redis_url, "LLMPIPE_MODEL": model, "LLMPIPE_ENGINE": "vllm",
            "LLMPIPE_STATE_DIR": str(tmp_path), "LLMPIPE_API_PORT": str(self.api_port), "LLMPIPE_KV_CACHE_GIB": "1",
            "LLMPIPE_MAX_BATCH_SIZE": "8", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_HOST_IP": "127.0.0.1",
            "TOKENIZERS_PARALLELISM": "false", **TEST_ENGINE_ENV, **settings,
        })
        env.pop("LLMPIPE_WORKER_KIND", None)
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        self.env = env
        self.sup = Supervisor(tmp_path / "logs", echo=False)
        self.probe = Celery(broker=redis_url, backend=redis_url)
        os.makedirs(tmp_path, exist_ok=True)

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @staticmethod
    def celery(*args: str) -> list[str]:
        import sys

        return [sys.executable, "-m", "celery", "-A", "tasks", *args]

    def start(self, name: str, *args: str, env: dict[str, str] | None = None):
        return self.sup.spawn(name, self.celery(*args), {**self.env, **(env or {})})

    def run(self, *args: str, timeout: float = 120.0):
        """A Celery command that exits (a refusing worker, inspect, purge, status)."""
        import subprocess

        return subprocess.run(self.celery(*args), env=self.env, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)

    def start_api(self):
        import sys

        argv = [sys.executable, "-m", "llmpipe.cli", "api", "--port", str(self.api_port)]
        return self.sup.spawn("api", argv, self.env)

    def _check_alive(self) -> None:
        from llmpipe.local.pipeline import exit_reason

        dead = self.sup.exited()
        if dead:
            raise AssertionError(exit_reason(dead[0]))

    def wait_nodes(self, *nodes: str, timeout: float = 240.0) -> None:
        """Until each node (``preprocess``, ``celery``: the name before @host) answers a ping."""
        import time

        end = time.monotonic() + timeout
        seen: set[str] = set()
        while time.monotonic() < end:
            self._check_alive()
            seen = {name.split("@")[0] for r in (self.probe.control.ping(timeout=0.5) or []) for name in r}
            if set(nodes) <= seen:
                return
        raise AssertionError(f"nodes {sorted(set(nodes) - seen)} did not answer within {timeout:.0f}s")

    def wait_http(self, url: str, timeout: float = 120.0, **kw) -> None:
        import time

        import httpx

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self._check_alive()
            try:
                if httpx.get(url, timeout=2, **kw).status_code < 500:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"{url} did not answer within {timeout:.0f}s")

    def submit(self, body: dict) -> str:
        import httpx

        r = httpx.post(f"{self.api_url}/v1/jobs", json=body, timeout=10)
        assert r.status_code == 202, r.text
        return r.json()["id"]

    def status(self, job_id: str) -> dict:
        import httpx

        return httpx.get(f"{self.api_url}/v1/jobs/{job_id}", timeout=10).json()

    def wait_job(self, job_id: str, timeout: float = 180.0) -> dict:
        import time

        import httpx

        end = time.monotonic() + timeout
        while True:  # long-polls of at most 60 s each (the API's limit)
            left = max(1.0, min(60.0, end - time.monotonic()))
            view = httpx.get(f"{self.api_url}/v1/jobs/{job_id}", params={"wait": left}, timeout=left + 10).json()
            if view["status"] not in ("queued", "running"):
                return view
            assert time.monotonic() < end, f"job {job_id} not done after {timeout:.0f}s: {view}"

    def stop(self) -> None:
        self.sup.stop(timeout=30)
        self.probe.close()


@pytest.fixture(scope="session")
def plain_celery():
    """The PlainCelery class (test modules cannot import this conftest)."""
    return PlainCelery


# Markers the test-only fault injector reacts to (llmpipe/testing/faulty.py).
FAULTS = {"poison": "POISONPILL", "fail_after_tokens": {"LATEPOISON": 8}, "ledger": True}


@pytest.fixture(scope="module")
def faulty_pipeline(tmp_path_factory, redis_server, tiny_model):
    """The transformers engine (one batch at a time) behind the fault injector; otherwise
    the shipped defaults."""
    import json

    import redis

    redis.Redis.from_url(redis_server.url).flushdb()
    p = start_pipeline(tmp_path_factory.mktemp("pipe-faulty"), redis_server.url, tiny_model, "transformers",
                       flower=False, extra_env=faulty.env(FAULTS))
    yield p
    teardown(p)
