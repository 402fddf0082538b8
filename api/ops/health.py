"""Whether the pipeline can serve now, for ``/healthz`` and vLLM's ``/health``: one check,
on the readiness keys that every warm worker keeps alive (llmpipe/observability/readiness.py)."""

from __future__ import annotations

from typing import Any

from llmpipe.errors import NoLiveWorkerError
from llmpipe.observability.readiness import STAGES, live_workers


def require_live_stages(r: Any, stages: tuple[str, ...] = STAGES) -> dict[str, int]:
    """Live workers per stage; NoLiveWorkerError (503, naming them) when a stage has none.
    ``stages``: with several models, each model's inference queue (``inference.tiny``) is
    one. Redis errors propagate."""
    counts = live_workers(r, stages)
    missing = [s for s in stages if not counts.get(s)]
    if missing:
        raise NoLiveWorkerError(missing)
    return counts
