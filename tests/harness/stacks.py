"""A test's LocalPipeline (real Celery workers, the API, an engine on the tiny model, Flower):
started on the tests' settings (``start_pipeline``) and torn down in one step (``teardown``);
``SharedPipeline``, one that several modules borrow in turn (tests/harness/shared.py)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import redis

from llmpipe.local.pipeline import LocalPipeline, settings_env
from llmpipe.local.redis_server import EmbeddedRedis, free_port
from llmpipe.settings import Settings
from llmpipe.stages import STAGE_QUEUES
from tests.harness.brokers import reset_broker_queues
from tests.harness.engine import TEST_ENGINE
from tests.harness.waiting import wait_until

# What every integration pipeline runs unless a test says otherwise: one CPU process per
# stage, batches of up to 16 gathered for 50 ms, the tests' engine (and its KV cache).
PIPELINE_DEFAULTS = dict(cpu_workers=1, max_batch_size=16, batch_window_ms=50, **TEST_ENGINE)


def teardown(lp: Any, timeout: float = 30.0) -> bool:
    """SIGTERM to every process of a ``LocalPipeline`` at once, SIGKILL to what is left at
    ``timeout``. ``LocalPipeline.stop`` goes stage by stage, each stage waiting for the one
    before it to exit, so that requests still running get through; a test's teardown has
    nothing left to get through, and the ordered stop took 9-17 s per stack here. The warm,
    pipeline-order stop keeps its own tests (tests/llmpipe/local/test_up.py,
    tests/llmpipe/local/test_supervisor.py)."""
    return lp.sup.stop(timeout=timeout)


def pipeline_settings(tmp_path: Path, redis_url: str, model: str, engine: str, **overrides) -> Settings:
    """The settings of a test's pipeline: PIPELINE_DEFAULTS, fresh ports, then ``overrides``."""
    return Settings(redis_url=redis_url, model=model, engine=engine, state_dir=tmp_path, api_port=free_port(),
                    flower_port=free_port(), **{**PIPELINE_DEFAULTS, **overrides})


def start_pipeline(tmp_path, redis_url, model, engine, *, flower=True, extra_env=None, **overrides) -> LocalPipeline:
    """A LocalPipeline on ``pipeline_settings``, ready (every worker answers its ping, the API
    its /healthz), or torn down and the error raised. ``extra_env`` goes to every process."""
    s = pipeline_settings(tmp_path, redis_url, model, engine, **overrides)
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(extra_env or {})}
    p = LocalPipeline(s, flower=flower, extra_env=env).start()
    try:
        p.wait_ready(timeout=240)
    except Exception:
        teardown(p, timeout=10)
        raise
    return p


# -- a pipeline lent to several modules (tests/harness/shared.py) ---------------------------
# Read by the API process alone: a module may ask for its own values of these on a shared
# stack, whose API restarts with them. Any other setting makes another stack.
API_SETTINGS = frozenset({"api_keys", "max_tokens_limit", "default_max_tokens", "max_n", "max_prompts_per_job",
                          "max_prompt_chars", "max_logprobs", "max_timeout_s"})
# What a module's jobs leave in Redis, deleted before the next module borrows the stack.
JOB_RECORDS = ("llmpipe:job:*", "celery-task-meta-*", "llmpipe:tokens:*", "llmpipe:job-done:*", "llmpipe:cancelled:*",
               "llmpipe:idem:*", "llmpipe:idem-key:*", "llmpipe:deadletter", "llmpipe:job-deadlines")


class SharedPipeline:
    """A pipeline (start_pipeline) on a Redis of its own, lent to each module that asks for
    the same engine, broker and worker settings. ``lend(**api_settings)`` hands it to the
    next module reset: the jobs of the module before have finished (no message queued or
    unacked) and their records are gone, and the API runs this module's API_SETTINGS (the
    API process restarts when they differ from the last module's)."""

    def __init__(self, tmp_path: Path, model: str, engine: str, *, broker_url: str | None = None, **overrides):
        assert not API_SETTINGS & overrides.keys(), "API settings are lend()'s"
        if broker_url:
            reset_broker_queues(broker_url)
        self.redis_server = EmbeddedRedis(tmp_path / "redis", appendonly=False).start()
        self.r = redis.Redis.from_url(self.redis_server.url)
        try:
            self.lp = start_pipeline(tmp_path, self.redis_server.url, model, engine, broker_url=broker_url, **overrides)
        except BaseException:
            self.redis_server.stop()
            raise
        self.base = self.lp.s
        api = self.lp.sup.get("api")
        self._api_env = {k: v for k, v in api.env.items() if k not in settings_env(self.base)}  # but the settings
        self.lent = 0

    def lend(self, **api_settings) -> LocalPipeline:
        assert API_SETTINGS >= api_settings.keys(), f"not API settings: {sorted(api_settings.keys() - API_SETTINGS)}"
        if self.lent:
            self._settle()
        want = self.base.model_copy(update=api_settings)
        if want != self.lp.s:
            self._restart_api(want)
        self.lent += 1
        return self.lp

    def _settle(self, timeout: float = 120) -> None:
        def idle() -> bool:
            queued = sum(self.r.llen(q) for q in STAGE_QUEUES) if not self.base.broker_is_amqp else 0
            return queued == 0 and self.r.hlen("unacked") == 0

        wait_until(idle, timeout, "the last module's jobs to finish", every=0.2)
        for pattern in JOB_RECORDS:
            keys = list(self.r.scan_iter(pattern, count=1000))
            if keys:
                self.r.delete(*keys)

    def _restart_api(self, s: Settings) -> None:
        api = self.lp.sup.get("api")
        api.proc.terminate()
        try:
            api.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(api.proc.pid, signal.SIGKILL)
            api.proc.wait(10)
        api.env = {**self._api_env, **settings_env(s)}
        self.lp.s = s
        self.lp.sup.respawn(api)
        wait_until(self.lp._api_answers, 60, "the API to answer with its new settings", every=0.1)

    def close(self) -> None:
        try:
            teardown(self.lp)
        finally:
            self.r.close()
            self.redis_server.stop()


def pipeline_key(engine: str, broker: str) -> tuple[str, str, str]:
    """The key of the shared pipeline of ``engine`` on ``broker`` ("redis" or "rabbitmq")."""
    return ("pipeline", engine, broker)


def borrow_pipeline(pool, tmp_path_factory, model: str, engine: str, *, broker_url: str | None = None,
                    **api_settings) -> LocalPipeline:
    """The pool's shared pipeline of ``engine`` (on RabbitMQ at ``broker_url``, else on its
    Redis), started on first use, lent with ``api_settings``."""
    key = pipeline_key(engine, "rabbitmq" if broker_url else "redis")
    stack = pool.get(key, lambda: SharedPipeline(tmp_path_factory.mktemp("-".join(key)), model, engine,
                                                 broker_url=broker_url), SharedPipeline.close)
    return stack.lend(**api_settings)
