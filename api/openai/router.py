"""OpenAI-compatible endpoints on the same three-stage pipeline: GET /v1/models, POST
/v1/completions and /v1/chat/completions (api/openai/service.py runs them)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Header, Request

from api.deps import OpenAI, Served
from api.errors import responses
from api.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from api.request_keys import HEADER
from api.security import require_key

router = APIRouter(prefix="/v1", tags=["openai"], dependencies=[Depends(require_key)])

_ERRS = responses(400, 404, 409, 422, 424, 429, 500, 503, 504)
_KEY_DOC = ("Makes retries safe: a retried POST with the same key (same API key, same body) waits on the job "
            "the first attempt made, or streams it from its first token, instead of making another.")


@router.get("/models", response_model=ModelList)
def models(served: Served) -> ModelList:
    """Every model this pipeline serves; the first is the default (a request without ``model``)."""
    return ModelList(data=[ModelCard(id=m.id) for m in served.models])


@router.post("/completions", response_model=CompletionResponse, responses=_ERRS)
async def completions(req: CompletionRequest, request: Request, serving: OpenAI,
                      idempotency_key: str | None = Header(None, alias=HEADER, description=_KEY_DOC)):
    """OpenAI completions; ``stream: true`` answers with server-sent events."""
    return await serving.completions(req, request, idempotency_key)


@router.post("/chat/completions", response_model=ChatCompletionResponse, responses=_ERRS)
async def chat_completions(req: ChatCompletionRequest, request: Request, serving: OpenAI,
                           idempotency_key: str | None = Header(None, alias=HEADER, description=_KEY_DOC)):
    """OpenAI chat completions with the model's chat template; ``stream: true`` answers with SSE."""
    return await serving.chat(req, request, idempotency_key)
