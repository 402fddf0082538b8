"""Whether the pipeline can serve now, for ``/healthz`` and vLLM's ``/health``: one check,
on the readiness keys that every warm worker keeps alive (llmpipe/observability/readiness.py)."""

from __future__ import annotations

from typing import Any

from llmpipe.errors import NoLiveWorkerError, UnavailableError
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


def healthz(r: Any, stages: tuple[str, ...]) -> dict:
    """``/healthz``'s body: Redis answers and every stage has a live worker. Redis errors
    propagate (api/errors.py answers them 503)."""
    r.ping()
    return {"status": "ok", "live_workers": require_live_stages(r, stages)}


def probe(r: Any, stages: tuple[str, ...]) -> None:
    """vLLM's ``/health``: returns once ready. Not ready is UnavailableError: api/errors.py
    gives it its status (503), Retry-After and x-should-retry, as every other error."""
    try:
        r.ping()
        require_live_stages(r, stages)
    except NoLiveWorkerError:
        raise
    except Exception as exc:
        raise UnavailableError("the queue (Redis) is unavailable") from exc
