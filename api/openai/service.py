"""The OpenAI endpoints on the job pipeline: a request becomes one job of ``n`` choices per
prompt, answered as JSON once it ends or streamed as server-sent events (api/openai/sse.py).

A :class:`Shape` is how one endpoint writes its answer (completions or chat): its chunks,
what a stream sends first, and the JSON response; :class:`OpenAIServing` runs either.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from fastapi import Request
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from api.detok import Detokenizers
from api.disconnect import unless_disconnected
from api.jobs.protocol import JobView
from api.jobs.service import JobService, Submitted, wait_view
from llmpipe.engines.kinds import engine_class
from api.openai.features import chat_choice, chat_extras, check_request, completion_choice, echo_text, stream_finish
from api.openai.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionTokensDetails,
    UsageOut,
)
from api.openai.sse import JobStream, stream_job
from api.request_keys import REPLAYED_HEADER, key_of
from api.token_streams import TokenStreams
from api.waiter import JobWaiter
from llmpipe.errors import BadRequestError, ExpiredError, LlmpipeError
from llmpipe.messages import ErrorReason, JobStatus, SamplingParams
from llmpipe.settings import Settings

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def raise_for(view: JobView) -> None:
    """The job did not succeed: raise its error, which api/errors.py maps to its status."""
    if view.status == JobStatus.SUCCEEDED:
        return
    err = view.error
    reason = err.type if err else ErrorReason.EXPIRED if view.status == JobStatus.EXPIRED else ErrorReason.INTERNAL
    raise LlmpipeError(err.message if err else f"job {view.status.value}", reason=reason, param=err.param if err else None)


def usage(view: JobView, n: int = 1) -> UsageOut:
    # As vLLM and OpenAI count: each prompt once, however many choices (n) it has.
    u = view.result.usage
    prompt = sum(r.prompt_tokens for r in view.result.results if r.index % n == 0) if n > 1 else u.prompt_tokens
    return UsageOut(prompt_tokens=prompt, completion_tokens=u.completion_tokens, total_tokens=prompt + u.completion_tokens)


@dataclass(frozen=True)
class CompletionShape:
    """vLLM's completion answer for ``req``, whose job inputs are ``inputs`` (one per prompt)."""

    req: CompletionRequest
    model: str  # the served model's id, as the answer names it
    inputs: list[dict]
    detok: Detokenizers

    def chunk(self, job_id: str, i: int, text: str, finish: str | None) -> dict:
        return {"id": f"cmpl-{job_id}", "object": "text_completion", "created": int(time.time()), "model": self.model,
                "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": finish}]}

    def first(self, job_id: str) -> list[dict]:
        """With echo, the prompt comes first, as vLLM streams it."""
        req = self.req
        if not req.echo:
            return []
        texts = [echo_text(inp, None if "prompt" in inp else
                           self.detok.get(req.model).decode_with_special(inp["prompt_token_ids"]))
                 for inp in self.inputs]
        return [self.chunk(job_id, i, texts[i // req.n], None) for i in range(len(self.inputs) * req.n)]

    def build(self, job_id: str, view: JobView) -> CompletionResponse:
        req = self.req
        return CompletionResponse(id=f"cmpl-{job_id}", model=self.model, usage=usage(view, req.n), choices=[
            CompletionChoice(**completion_choice(r, req, self.inputs[r.index // req.n])) for r in view.result.results])


@dataclass(frozen=True)
class ChatShape:
    """vLLM's chat completion answer for ``req``."""

    req: ChatCompletionRequest
    model: str
    inputs: list[dict]
    reasoning: bool = False  # the model has a reasoning parser: usage counts reasoning tokens (vLLM)

    def chunk(self, job_id: str, i: int, text: str | dict, finish: str | None) -> dict:
        """``text``: a content delta, or a delta message (content, reasoning, tool_calls)."""
        delta = text if isinstance(text, dict) else {"content": text} if text or finish is None else {}
        if self.req.legacy_functions:
            delta = _as_function_call(delta)
            finish = "function_call" if finish == "tool_calls" else finish
        return {"id": f"chatcmpl-{job_id}", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model, "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    def first(self, job_id: str) -> list[dict]:
        """Each choice's first chunk names the answer's role; with echo, the echoed content follows."""
        out = []
        echo = self.req.echo_text()
        for i in range(self.req.n):
            c = self.chunk(job_id, i, "", None)
            c["choices"][0]["delta"] = {"role": self.req.response_role(), "content": ""}
            out.append(c)
        out += [self.chunk(job_id, i, echo, None) for i in range(self.req.n) if echo]
        return out

    def usage(self, view: JobView) -> UsageOut:
        u = usage(view, self.req.n)
        if self.reasoning:  # vLLM counts the reasoning tokens when the model has a reasoning parser
            u.completion_tokens_details = CompletionTokensDetails(
                reasoning_tokens=sum(r.parsed.reasoning_tokens for r in view.result.results if r.parsed is not None))
        return u

    def build(self, job_id: str, view: JobView) -> ChatCompletionResponse:
        results = view.result.results
        return ChatCompletionResponse(id=f"chatcmpl-{job_id}", model=self.model, usage=self.usage(view),
                                      choices=[ChatChoice(**chat_choice(r, self.req)) for r in results],
                                      **chat_extras(results, self.req))


def _as_function_call(delta: dict) -> dict:
    """A delta's first tool call as OpenAI's older ``function_call`` (the request sent ``functions``)."""
    if not delta.get("tool_calls"):
        return delta
    out = {k: v for k, v in delta.items() if k != "tool_calls"}
    fn = next((c.get("function") or {} for c in delta["tool_calls"] if c.get("index", 0) == 0), None)
    if fn:
        out["function_call"] = {k: v for k, v in fn.items() if v is not None}
    return out


Shape = CompletionShape | ChatShape


@dataclass(frozen=True)
class Prepared:
    """A request as its job: the answer's shape and, per choice (``n`` per prompt), the job
    input and its sampling. The synchronous endpoints and the Batch API (api/batches/) both
    make it here, so a batch line and a request of the same body run the same job."""

    shape: Shape
    inputs: list[dict]
    params: list[SamplingParams]


def _check(req: CompletionRequest | ChatCompletionRequest, jobs: JobService, settings: Settings,
           params: SamplingParams) -> str:
    """The served model's id for the request's ``model`` (404 ``model_not_found`` for one not
    served), once the request is one this server can answer (``params``: its first choice's)."""
    model = jobs.models.get(req.model).id
    check_request(req, settings, params)
    if req.n > settings.max_n:
        raise BadRequestError(f"n may be at most {settings.max_n} (max_n); got {req.n}", param="n")
    return model


def _prepared(shape: Shape, params_for) -> Prepared:
    n = shape.req.n
    return Prepared(shape, [inp for inp in shape.inputs for _ in range(n)],
                    [params_for(k) for _ in shape.inputs for k in range(n)])


def prepare_completion(req: CompletionRequest, jobs: JobService, settings: Settings, detok: Detokenizers) -> Prepared:
    max_tokens = 16 if req.max_tokens is None else max(1, req.max_tokens)  # 0: echo only (vLLM)
    model = _check(req, jobs, settings, req.sampling(max_tokens))
    return _prepared(CompletionShape(req, model, req.inputs(), detok), lambda k: req.sampling(max_tokens, k))


def prepare_chat(req: ChatCompletionRequest, jobs: JobService, settings: Settings) -> Prepared:
    max_tokens = req.max_completion_tokens or req.max_tokens or settings.default_max_tokens
    score = engine_class(settings.engine, settings.sim_continuous).supports_logprobs
    model = _check(req, jobs, settings, req.sampling(max_tokens, score_echo=score))
    messages = [m.to_message() for m in req.messages]
    pieces = [t for m in req.messages for t in m.pieces()]
    inp = {"messages": messages, "limit_pieces": pieces, "parsing": req.output_parsing(),
           "chat": req.chat_template_options(settings.trust_request_chat_template)}
    shape = ChatShape(req, model, [inp], settings.parsers(req.model).reasoning_parser is not None)
    return _prepared(shape, lambda k: req.sampling(max_tokens, k, score_echo=score))


# The request body of each endpoint, and how it becomes a job.
REQUESTS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}


def prepare(endpoint: str, req: CompletionRequest | ChatCompletionRequest, jobs: JobService, settings: Settings,
            detok: Detokenizers) -> Prepared:
    if endpoint == "/v1/completions":
        return prepare_completion(req, jobs, settings, detok)
    return prepare_chat(req, jobs, settings)


class OpenAIServing:
    """Runs OpenAI requests as jobs, with the app's collaborators (api/deps.py)."""

    def __init__(self, jobs: JobService, waiter: JobWaiter, settings: Settings, detok: Detokenizers,
                 streams: TokenStreams):
        self.jobs = jobs
        self.waiter = waiter
        self.settings = settings
        self.detok = detok
        self.streams = streams

    async def completions(self, req: CompletionRequest, request: Request, key_header: str | None) -> BaseModel | Response:
        return await self._run(request, key_header, prepare_completion(req, self.jobs, self.settings, self.detok))

    async def chat(self, req: ChatCompletionRequest, request: Request, key_header: str | None) -> BaseModel | Response:
        return await self._run(request, key_header, prepare_chat(req, self.jobs, self.settings))

    async def _run(self, request: Request, key_header: str | None, prep: Prepared) -> BaseModel | Response:
        """Submit ``n`` choices per input as one job; answer as JSON or as SSE. ``key_header``:
        the request's Idempotency-Key."""
        shape, req = prep.shape, prep.shape.req
        key = key_of(request, key_header, req)
        sub = await run_in_threadpool(
            self.jobs.submit_inputs, prep.inputs, prep.params, timeout=req.timeout, stream=req.stream, kind="openai",
            key=key, waiting=True, choices=req.n, priority=req.priority, model=req.model)
        if req.stream:
            return self._stream(sub, shape, len(prep.inputs))
        view = await self._wait(request, sub)
        raise_for(view)
        return shape.build(sub.job_id, view)

    def _stream(self, sub: Submitted, shape: Shape, n_choices: int) -> JobStream:
        req, job_id = shape.req, sub.job_id
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)

        def usage_chunk(view: JobView) -> dict:
            u = shape.usage(view) if isinstance(shape, ChatShape) else usage(view, req.n)
            return {**shape.chunk(job_id, 0, "", None), "choices": [], "usage": u.model_dump(exclude_none=True)}

        gen = stream_job(
            job_id=job_id, n_choices=n_choices, stops=req.stops(), service=self.jobs, waiter=self.waiter,
            streams=self.streams, detok=self.detok.get(req.model), chunk=lambda i, t, f: shape.chunk(job_id, i, t, f),
            first=shape.first(job_id), usage_chunk=usage_chunk if include_usage else None, deadline=sub.deadline,
            continuous_usage=include_usage and bool(opts and opts.continuous_usage_stats), stop_ids=req.stop_token_ids,
            opts=req.detokenizing(), ignore_eos=req.ignore_eos,
            finish=(lambda r, streamed: stream_finish(r, req, streamed)) if isinstance(shape, ChatShape) else None)
        headers = {**_SSE_HEADERS, **({REPLAYED_HEADER: "true"} if sub.replayed else {})}
        return JobStream(gen, on_abandon=lambda: self.jobs.abandon(job_id), media_type="text/event-stream",
                         headers=headers)

    async def _wait(self, request: Request, sub: Submitted) -> JobView:
        """The job's view once it ended; cancelled if the client goes away first, expired at
        its deadline."""
        jobs, job_id = self.jobs, sub.job_id
        # The job runs already: a Redis blip while waiting is waited out, not answered with a
        # 503 that the client would retry into a second job.
        view = await unless_disconnected(
            request, wait_view(jobs, self.waiter, job_id, max(0.1, sub.deadline - time.time() + 2), partial=False,
                               through_outage=True),
            on_gone=lambda: jobs.abandon(job_id))
        if not view.status.terminal:
            await run_in_threadpool(jobs.expire, job_id, "the request passed its deadline")
            view = await run_in_threadpool(jobs.view, job_id, False)
            if not view.status.terminal:
                raise ExpiredError("the request passed its deadline")
        return view
