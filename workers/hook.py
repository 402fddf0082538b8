"""The one way into a worker from outside the runtime: ``LLMPIPE_WORKER_HOOK=module:callable``.

Every worker process calls the callable once, when it loads (workers/signals.py), with no
arguments. What it returns, when not None, wraps each engine the process builds:
``wrapper(engine, settings, model_path) -> Engine``. The tests set it to
``llmpipe.testing.faulty:install`` (fault injection); a production worker leaves it unset.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from kombu.utils.imports import symbol_by_name

ENV = "LLMPIPE_WORKER_HOOK"

EngineWrapper = Callable[[Any, Any, "str | None"], Any]
_wrapper: EngineWrapper | None = None


def install(spec: str | None = None) -> None:
    """Call the hook named by ``spec`` (default: the variable), once per process."""
    global _wrapper
    if spec is None:
        spec = os.environ.get(ENV, "")
    if spec:
        _wrapper = symbol_by_name(spec)()


def wrap_engine(engine: Any, settings: Any, model_path: str | None) -> Any:
    """``engine`` as the hook wraps it, or ``engine`` itself without a hook."""
    return engine if _wrapper is None else _wrapper(engine, settings, model_path)
