"""Operator endpoints: ``/healthz`` (no API key, as vLLM's probes), ``/metrics`` and the
dead-letter record (``/v1/admin/deadletters``)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api.deps import DeadLetterLog, Redis, Registries, Served
from api.errors import responses
from api.ops import health
from api.security import require_key
from llmpipe.errors import NotFoundError

router = APIRouter()

_KEYED = [Depends(require_key)]


@router.get("/metrics", tags=["ops"], response_class=Response, responses={200: {"content": {"text/plain": {}}}},
            dependencies=_KEYED)
def metrics(registries: Registries) -> Response:
    """Prometheus metrics of the API and all workers (multiprocess mode)."""
    return Response(b"".join(generate_latest(reg) for reg in registries), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/admin/deadletters", tags=["admin"], dependencies=_KEYED)
def list_deadletters(dl: DeadLetterLog, limit: int = Query(100, ge=1, le=1000)) -> dict:
    """Requests that kept failing (after retries, or past the delivery limit), newest first."""
    return {"count": dl.count(), "data": dl.list(limit)}


@router.delete("/v1/admin/deadletters/{entry_id}", tags=["admin"], status_code=204,
               responses={404: {"description": "Unknown entry"}}, dependencies=_KEYED)
def delete_deadletter(entry_id: str, dl: DeadLetterLog) -> None:
    """Forget one dead letter once handled."""
    if not dl.remove(entry_id):
        raise NotFoundError(f"no dead letter with id {entry_id!r}", param="entry_id")


@router.get("/healthz", tags=["ops"], responses=responses(503))
def healthz(r: Redis, served: Served):
    """Ready to serve: Redis answers and every stage has a live worker; else 503 naming
    what is missing (``stages``; with several models, a model's
    inference queue, such as ``inference.tiny``). Needs no API key. A stage whose last worker died is
    seen within 15 s (the readiness keys' TTL)."""
    return JSONResponse(health.healthz(r, served.readiness_stages()))
