"""A test's stack, torn down."""

from __future__ import annotations

from typing import Any


def teardown(lp: Any, timeout: float = 30.0) -> bool:
    """SIGTERM to every process of a ``LocalPipeline`` at once, SIGKILL to what is left at
    ``timeout``. ``LocalPipeline.stop`` goes stage by stage, each stage waiting for the one
    before it to exit, so that requests still running get through; a test's teardown has
    nothing left to get through, and the ordered stop took 9-17 s per stack here. The warm,
    pipeline-order stop keeps its own tests (tests/llmpipe/test_up.py,
    tests/llmpipe/test_supervisor.py)."""
    return lp.sup.stop(timeout=timeout)
