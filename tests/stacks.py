"""A test's stack, torn down."""

from __future__ import annotations

from typing import Any


def teardown(lp: Any, timeout: float = 30.0) -> bool:
    """SIGTERM to every process of a ``LocalPipeline`` at once, SIGKILL to what is left at
    ``timeout``. ``LocalPipeline.stop`` goes stage by stage, each stage waiting for the one
    before it to exit, so that requests still running get through; a test's teardown has
    nothing left to get through, and the ordered stop took 9-17 s per stack here. The warm,
    pipeline-order stop keeps its own tests (tests/llmpipe/local/test_up.py,
    tests/llmpipe/local/test_supervisor.py)."""
    return lp.sup.stop(timeout=timeout)


# The engine of a test's stack: float32, so that token ids match exactly between engines and
# runs; eager, so that an engine starts in seconds instead of compiling. The shipped
# defaults (vLLM's own: dtype auto, compiled) run where a test is about them: the kill
# matrix (tests/reliability/harness/up_pipe.py) and tests/integration/test_shipped_defaults.py.
TEST_ENGINE = {"dtype": "float32", "enforce_eager": True}
TEST_ENGINE_ENV = {"LLMPIPE_DTYPE": "float32", "LLMPIPE_ENFORCE_EAGER": "true"}
