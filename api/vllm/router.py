"""The endpoints of vLLM's OpenAI server that its clients probe besides /v1: ``/health``,
``/ping``, ``/version``, ``/tokenize`` and ``/detokenize``, in vLLM's shapes.

* ``/health`` (and ``/ping``, SageMaker's name for it) answers 200 with an empty body once
  Redis answers and every stage has a ready worker (llmpipe/observability/readiness.py), else 503 with
  the error body naming what is missing: the same check as ``/healthz`` (api/ops/health.py).
  These and ``/version`` need no API key, as ``/healthz``; ``/tokenize`` and ``/detokenize`` do.
* ``/tokenize`` and ``/detokenize``: api/vllm/service.py.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from api.deps import AppSettings, CeleryApp, Detoks, Redis, Served, Waiter
from api.errors import ErrorResponse, responses
from api.ops.health import probe
from api.security import require_key
from api.vllm import service
from api.vllm.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    VersionResponse,
)
from llmpipe.models.served import ModelSet

router = APIRouter(tags=["vllm"])

_HEALTH_DOC = {200: {"description": "Ready: every stage has a worker"},
               503: {"model": ErrorResponse, "description": "Redis or a stage's worker is not ready"}}
_ERRS = responses(400, 404, 503)
_KEYED = [Depends(require_key)]


async def _health(r: Any, served: ModelSet) -> Response:
    await run_in_threadpool(probe, r, served.readiness_stages())
    return Response(status_code=200)


@router.get("/health", responses=_HEALTH_DOC)
async def health(r: Redis, served: Served) -> Response:
    """vLLM's readiness probe: 200 once Redis and a worker for every stage are ready, else 503."""
    return await _health(r, served)


@router.get("/ping", responses=_HEALTH_DOC)
async def ping(r: Redis, served: Served) -> Response:
    """The same as /health (SageMaker's name for it)."""
    return await _health(r, served)


@router.post("/ping", responses=_HEALTH_DOC)
async def ping_post(r: Redis, served: Served) -> Response:
    """The same as /health (SageMaker sends POST)."""
    return await _health(r, served)


@router.get("/version", response_model=VersionResponse)
def version(settings: AppSettings) -> VersionResponse:
    """The engine's version as vLLM answers it, with llmpipe's own and the engine's name."""
    return service.version(settings)


@router.post("/tokenize", response_model=TokenizeResponse, responses=_ERRS, dependencies=_KEYED)
async def tokenize(req: TokenizeCompletionRequest | TokenizeChatRequest, celery: CeleryApp, r: Redis,
                   waiter: Waiter, served: Served) -> TokenizeResponse:
    """vLLM's /tokenize: a prompt, or chat messages through the chat template, to the ids the
    pipeline would give the engine (answered by a preprocess worker)."""
    return await service.tokenize(req, celery=celery, r=r, waiter=waiter, served=served)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRS, dependencies=_KEYED)
async def detokenize(req: DetokenizeRequest, detok: Detoks, served: Served) -> DetokenizeResponse:
    """vLLM's /detokenize: token ids to text, special tokens kept."""
    return await service.detokenize(req, detok=detok, served=served)
