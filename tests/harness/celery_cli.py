"""Processes started as a Celery user would start them (README.md, "Celery's own commands"):
``celery -A tasks worker|flower|inspect|purge`` and ``llmpipe api``, for the integration
tests of Celery's own commands."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
from celery import Celery

from llmpipe.local.pipeline import exit_reason
from llmpipe.local.redis_server import free_port
from llmpipe.local.supervisor import Supervisor, python_env
from tests.harness.clients import job_view, submit_job
from tests.harness.engine import TEST_ENGINE_ENV
from tests.harness.waiting import poll


class PlainCelery:
    """Processes started as a Celery user would: ``celery -A tasks worker|flower|...`` with
    no LLMPIPE_WORKER_KIND and no pool, concurrency or node-name flags, plus ``llmpipe api``.
    Settings come from LLMPIPE_* variables; vLLM on the tiny model."""

    def __init__(self, tmp_path, redis_url: str, model: str, **settings: str):
        self.redis_url = redis_url
        self.api_port = free_port()
        self.flower_port = free_port()
        env = python_env({
            "LLMPIPE_REDIS_URL": redis_url, "LLMPIPE_MODEL": model, "LLMPIPE_ENGINE": "vllm",
            "LLMPIPE_STATE_DIR": str(tmp_path), "LLMPIPE_API_PORT": str(self.api_port),
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
        return [sys.executable, "-m", "celery", "-A", "tasks", *args]

    def start(self, name: str, *args: str, env: dict[str, str] | None = None):
        return self.sup.spawn(name, self.celery(*args), {**self.env, **(env or {})})

    def run(self, *args: str, timeout: float = 120.0):
        """A Celery command that exits (a refusing worker, inspect, purge, status)."""
        return subprocess.run(self.celery(*args), env=self.env, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)

    def start_api(self):
        argv = [sys.executable, "-m", "llmpipe.cli", "api", "--port", str(self.api_port)]
        return self.sup.spawn("api", argv, self.env)

    def _check_alive(self) -> None:
        dead = self.sup.exited()
        if dead:
            raise AssertionError(exit_reason(dead[0]))

    def wait_nodes(self, *nodes: str, timeout: float = 240.0) -> None:
        """Until each node (``preprocess``, ``celery``: the name before @host) answers a ping."""
        seen: set[str] = set()

        def answered() -> bool:
            self._check_alive()
            seen.clear()
            seen.update(name.split("@")[0] for r in (self.probe.control.ping(timeout=0.5) or []) for name in r)
            return set(nodes) <= seen

        if not poll(answered, timeout, every=0):
            raise AssertionError(f"nodes {sorted(set(nodes) - seen)} did not answer within {timeout:.0f}s")

    def wait_http(self, url: str, timeout: float = 120.0, **kw) -> None:
        """Until ``url`` answers below 500 (``kw``: httpx.get's, e.g. auth)."""
        def answers() -> bool:
            self._check_alive()
            try:
                return httpx.get(url, timeout=2, **kw).status_code < 500
            except httpx.HTTPError:
                return False

        if not poll(answers, timeout, every=0.2):
            raise AssertionError(f"{url} did not answer within {timeout:.0f}s")

    def submit(self, body: dict) -> str:
        return submit_job(self.api_url, body)

    def status(self, job_id: str) -> dict:
        return job_view(self.api_url, job_id)

    def wait_job(self, job_id: str, timeout: float = 180.0) -> dict:
        """The job's view once it ended, in long-polls of at most 60 s each (the API's limit)."""
        end = time.monotonic() + timeout
        last: dict = {}

        def ended() -> bool:
            left = max(1.0, min(60.0, end - time.monotonic()))
            last["view"] = job_view(self.api_url, job_id, wait=left)
            return last["view"]["status"] not in ("queued", "running")

        if not poll(ended, timeout, every=0):
            raise AssertionError(f"job {job_id} not done after {timeout:.0f}s: {last['view']}")
        return last["view"]

    def stop(self) -> None:
        self.sup.stop(timeout=30)
        self.probe.close()
