"""A test's LocalPipeline (real Celery workers, the API, an engine on the tiny model, Flower):
started on the tests' settings and torn down in one step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmpipe.local.pipeline import LocalPipeline
from llmpipe.local.redis_server import free_port
from llmpipe.settings import Settings
from tests.harness.engine import TEST_ENGINE

# What every integration pipeline runs unless a test says otherwise: one CPU process per
# stage, batches of up to 16 gathered for 50 ms, a 1 GiB KV cache, the tests' engine.
PIPELINE_DEFAULTS = dict(cpu_workers=1, max_batch_size=16, batch_window_ms=50, kv_cache_gib=1, **TEST_ENGINE)


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
