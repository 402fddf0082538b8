"""OpenAI-compatible endpoints on the same three-stage pipeline."""

from __future__ import annotations

import time

from fastapi import APIRouter, Header, Request
from starlette.concurrency import run_in_threadpool

from api.detok import Detokenizers
from api.disconnect import unless_disconnected
from api.errors import ERROR_RESPONSES, ErrorResponse
from api.jobs.protocol import JobView
from api.jobs.router import REPLAYED_HEADER, bearer, wait_view
from api.jobs.service import JobService
from api.openai.features import chat_choice, chat_extras, check_request, completion_choice, echo_text
from api.openai.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    UsageOut,
)
from api.openai.sse import JobStream, stream_job
from api.request_keys import HEADER, request_key
from api.waiter import JobWaiter
from llmpipe.broker.redis_clients import afrom_settings
from llmpipe.errors import BadRequestError, ExpiredError, LlmpipeError
from llmpipe.messages import ErrorReason, JobStatus
from llmpipe.settings import Settings

_ERRS = {c: {"model": ErrorResponse, **ERROR_RESPONSES[c]} for c in (400, 404, 409, 422, 424, 429, 500, 503, 504)}
_KEY_DOC = ("Makes retries safe: a retried POST with the same key (same API key, same body) waits on the job "
            "the first attempt made, or streams it from its first token, instead of making another.")


def raise_for(view: JobView) -> None:
    """The job did not succeed: raise its error, which api/errors.py maps to its status."""
    if view.status == JobStatus.SUCCEEDED:
        return
    err = view.error
    reason = err.type if err else ErrorReason.EXPIRED if view.status == JobStatus.EXPIRED else ErrorReason.INTERNAL
    raise LlmpipeError(err.message if err else f"job {view.status.value}", reason=reason, param=err.param if err else None)


def _usage(view: JobView, n: int = 1) -> UsageOut:
    # As vLLM and OpenAI count: each prompt once, however many choices (n) it has.
    u = view.result.usage
    prompt = sum(r.prompt_tokens for r in view.result.results if r.index % n == 0) if n > 1 else u.prompt_tokens
    return UsageOut(prompt_tokens=prompt, completion_tokens=u.completion_tokens, total_tokens=prompt + u.completion_tokens)


def router(service: JobService, waiter: JobWaiter, settings: Settings, detok: Detokenizers) -> APIRouter:
    rt = APIRouter(prefix="/v1", tags=["openai"])
    served = settings.served  # llmpipe/models/served.py
    aredis = afrom_settings(settings, socket_connect_timeout=2)

    def check_model(name: str | None) -> str:
        """The served model's id for the request's ``model`` (None: the default); 404
        ``model_not_found`` for one not served (ModelNotFoundError, api/errors.py)."""
        return served.get(name).id

    def limits(n: int) -> None:
        if n > settings.max_n:
            raise BadRequestError(f"n may be at most {settings.max_n} (max_n); got {n}", param="n")

    async def run(request, key_header, body, inputs, params_for, n, stream, timeout, build, chunk, first, stops,
                  include_usage, continuous_usage=False):
        """Submit ``n`` choices per input as one job; answer as JSON or as SSE."""
        key = request_key(key_header, api_key=bearer(request), path=request.url.path, body=body)
        job_inputs = [inp for inp in inputs for _ in range(n)]
        params = [params_for(k) for _ in inputs for k in range(n)]
        sub = await run_in_threadpool(
            service.submit_inputs, job_inputs, params, timeout=timeout, stream=stream, kind="openai", key=key,
            waiting=True, choices=n, priority=body.priority, model=body.model)
        job_id = sub.job_id
        if stream:
            def usage_chunk(view: JobView) -> dict:
                return {**chunk(job_id, 0, "", None), "choices": [], "usage": _usage(view, n).model_dump()}

            gen = stream_job(
                job_id=job_id, n_choices=len(job_inputs), stops=stops, service=service, waiter=waiter, aredis=aredis,
                detok=detok.get(body.model), chunk=lambda i, t, f: chunk(job_id, i, t, f), first=first(job_id),
                usage_chunk=usage_chunk if include_usage else None, deadline=sub.deadline,
                continuous_usage=include_usage and continuous_usage, stop_ids=body.stop_token_ids)
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            if sub.replayed:
                headers[REPLAYED_HEADER] = "true"
            return JobStream(gen, on_abandon=lambda: service.abandon(job_id), media_type="text/event-stream",
                             headers=headers)
        # The job runs already: a Redis blip while waiting is waited out, not answered with a
        # 503 that the client would retry into a second job.
        wait = unless_disconnected(
            request, wait_view(service, waiter, job_id, max(0.1, sub.deadline - time.time() + 2), partial=False,
                               through_outage=True),
            on_gone=lambda: service.abandon(job_id))
        view = await wait
        if not view.status.terminal:
            await run_in_threadpool(service.expire, job_id, "the request passed its deadline")
            view = await run_in_threadpool(service.view, job_id, False)
            if not view.status.terminal:
                raise ExpiredError("the request passed its deadline")
        raise_for(view)
        return build(job_id, view)

    @rt.get("/models", response_model=ModelList)
    def models() -> ModelList:
        """Every model this pipeline serves; the first is the default (a request without ``model``)."""
        return ModelList(data=[ModelCard(id=m.id) for m in served.models])

    @rt.post("/completions", response_model=CompletionResponse, responses=_ERRS)
    async def completions(req: CompletionRequest, request: Request,
                          idempotency_key: str | None = Header(None, alias=HEADER, description=_KEY_DOC)):
        """OpenAI completions; ``stream: true`` answers with server-sent events."""
        model = check_model(req.model)
        check_request(req, settings)
        max_tokens = 16 if req.max_tokens is None else max(1, req.max_tokens)  # 0: echo only (vLLM)
        limits(req.n)
        inputs = req.inputs()

        def first(job_id):  # echo: the prompt comes first, as vLLM streams it
            if not req.echo:
                return []
            texts = [echo_text(inp, None if "prompt" in inp else detok.get(req.model).decode_with_special(inp["prompt_token_ids"]))
                     for inp in inputs]
            return [chunk(job_id, i, texts[i // req.n], None) for i in range(len(inputs) * req.n)]

        def chunk(job_id, i, text, finish):
            return {"id": f"cmpl-{job_id}", "object": "text_completion", "created": int(time.time()), "model": model,
                    "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": finish}]}

        def build(job_id, view):
            return CompletionResponse(id=f"cmpl-{job_id}", model=model, usage=_usage(view, req.n), choices=[
                CompletionChoice(**completion_choice(r, req, inputs[r.index // req.n])) for r in view.result.results])

        return await run(request, idempotency_key, req, inputs, lambda k: req.sampling(max_tokens, k), req.n,
                         req.stream, req.timeout, build, chunk, first, req.stops(),
                         bool(req.stream_options and req.stream_options.include_usage),
                         bool(req.stream_options and req.stream_options.continuous_usage_stats))

    @rt.post("/chat/completions", response_model=ChatCompletionResponse, responses=_ERRS)
    async def chat_completions(req: ChatCompletionRequest, request: Request,
                               idempotency_key: str | None = Header(None, alias=HEADER, description=_KEY_DOC)):
        """OpenAI chat completions with the model's chat template; ``stream: true`` answers with SSE."""
        model = check_model(req.model)
        check_request(req, settings)
        max_tokens = req.max_completion_tokens or req.max_tokens or settings.default_max_tokens
        limits(req.n)

        def chunk(job_id, i, text, finish):
            delta = {"content": text} if text or finish is None else {}
            return {"id": f"chatcmpl-{job_id}", "object": "chat.completion.chunk", "created": int(time.time()),
                    "model": model, "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        def first(job_id):
            out = []
            for i in range(req.n):
                c = chunk(job_id, i, "", None)
                c["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                out.append(c)
            return out

        def build(job_id, view):
            results = view.result.results
            return ChatCompletionResponse(id=f"chatcmpl-{job_id}", model=model, usage=_usage(view, req.n),
                                          choices=[ChatChoice(**chat_choice(r, req)) for r in results],
                                          **chat_extras(results, req))

        messages = [m.to_message() for m in req.messages]
        pieces = [t for m in req.messages for t in m.pieces()]
        return await run(request, idempotency_key, req, [{"messages": messages, "limit_pieces": pieces}], lambda k: req.sampling(max_tokens, k),
                         req.n, req.stream,
                         req.timeout, build, chunk, first, req.stops(),
                         bool(req.stream_options and req.stream_options.include_usage),
                         bool(req.stream_options and req.stream_options.continuous_usage_stats))

    return rt
