"""Server-sent events for ``stream: true``: token deltas from the job's Redis stream.

A choice's ids are decoded here with vLLM's detokenizer and the request's detokenizing
options (llmpipe/processors/detokenize.py, as postprocess decodes them), or, for a chat
output that the model's parsers parse, the inference worker's delta messages (content,
reasoning, tool calls: llmpipe/parsing/streams.py) are relayed as they are, in vLLM's
shape. What is sent is always the beginning of the final answer: what the inference worker
publishes is never taken back (a request that runs again resumes from it), and the last
chunk completes the answer from the job's result. A client that disconnects has its job
cancelled (:class:`JobStream`), and the engine aborts its requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable

import anyio
from starlette.concurrency import run_in_threadpool
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from api.detok import Detokenizer
from api.errors import error_event
from api.jobs.protocol import JobView
from api.jobs.service import JobService
from api.token_streams import TokenStreams
from api.waiter import JobWaiter
from llmpipe.jobs.streaming import PromptInfo, apply_entries, is_end
from llmpipe.messages import Detokenizing, ErrorReason, JobStatus, Parsed, PromptResult
from llmpipe.processors.detokenize import IncrementalDetokenizer

log = logging.getLogger("llmpipe.api")

FALLBACK_S = 1.0  # a silent stream's record is read this often (the end marker wakes it first)

# chunk(index, text delta or delta message, finish_reason) -> the OpenAI chunk object for one choice
ChunkFn = Callable[[int, str | dict, str | None], dict]
# finish(result, tool calls were streamed) -> the stream's last finish_reason
FinishFn = Callable[[PromptResult, bool], str]


def sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n".encode()


class _Choice:
    """Streamed text of one choice: vLLM's detokenizer over its ids, which holds back as many
    characters as the longest stop string, less one, so a stop is never half sent. An id in
    ``stop_ids`` (the request's stop ids, EOS unless ignore_eos) ends the output: the engine
    stops there, and its text is left out unless include_stop_str_in_output."""

    def __init__(self, detok: IncrementalDetokenizer, stop_ids: frozenset[int] = frozenset()):
        self.detok = detok
        self.stop_ids = stop_ids
        self.stopped = False
        self.completed = False

    def push(self, ids: list[int]) -> str:
        for t in ids:
            if self.stopped:
                break
            self.stopped = self.detok.update([t], stop_terminated=t in self.stop_ids) is not None or t in self.stop_ids
        return self.detok.next_text()

    def rest(self, final_text: str) -> str:
        """What the final result adds beyond what was sent (once)."""
        sent = self.detok.text[: self.detok.sent]
        if self.completed or not final_text.startswith(sent):
            return ""
        self.completed = True
        return final_text[len(sent):]

    def rest_delta(self, r: PromptResult) -> str | dict:
        return self.rest(r.text if r.parsed is None else r.parsed.content or "")


class _ParsedChoice:
    """A choice whose delta messages the inference worker parsed: relayed as they are; what
    they said is kept, so that the last chunk adds what postprocess's result has beyond it."""

    def __init__(self) -> None:
        self.content = ""
        self.reasoning = ""
        self.calls: dict[int, dict] = {}  # index -> {"name": ..., "arguments": ...} sent so far
        # The parser saw the end: what it sent is the whole stream, vLLM's (for an output cut
        # inside a tool call that is not the finished answer, which has no call: vLLM's
        # stream and answer differ there too, and deltas sent are never taken back).
        self.ended = False

    def relay(self, deltas: list[dict]) -> list[dict]:
        for d in deltas:
            self.content += d.get("content") or ""
            self.reasoning += d.get("reasoning") or ""
            for c in d.get("tool_calls") or []:
                sent = self.calls.setdefault(c["index"], {"name": "", "arguments": ""})
                fn = c.get("function") or {}
                sent["name"] += fn.get("name") or ""
                sent["arguments"] += fn.get("arguments") or ""
        return deltas

    def rest_delta(self, r: PromptResult) -> dict:
        if self.ended:
            return {}
        p = r.parsed or Parsed(content=r.text)
        out: dict = {}
        content, reasoning = _beyond(self.content, p.content), _beyond(self.reasoning, p.reasoning)
        if content:
            out["content"] = content
        if reasoning:
            out["reasoning"] = reasoning
        calls = []
        for j, call in enumerate(p.tool_calls):
            sent = self.calls.get(j)
            if sent is None:
                calls.append({"index": j, "id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": call.function.arguments}})
            elif rest := _beyond(sent["arguments"], call.function.arguments):
                calls.append({"index": j, "function": {"arguments": rest}})
        if calls:
            out["tool_calls"] = calls
        return out


def _beyond(sent: str, final: str | None) -> str:
    return final[len(sent):] if final and final.startswith(sent) else ""


class _Choices:
    """The streamed choices of one job: each choice's text decoded from the token ids of the
    job's stream, or its parsed delta messages relayed, as SSE chunks (``chunk``), with the
    usage so far when ``continuous_usage``."""

    def __init__(self, loading: asyncio.Future, n_choices: int, stops: list[str], stop_ids: frozenset[int],
                 chunk: ChunkFn, continuous_usage: bool, opts: Detokenizing, finish: FinishFn | None = None):
        self.loading = loading  # (the tokenizer, the EOS ids that end an output), loading
        self.n_choices = n_choices
        self.stops = stops
        self.stop_ids = stop_ids
        self.chunk = chunk
        self.continuous_usage = continuous_usage
        self.opts = opts
        self.finish_of = finish or (lambda r, calls_streamed: r.finish_reason.value)
        self.choices: dict[int, _Choice | _ParsedChoice] = {}
        self.ids: dict[int, list[int]] = {}
        self.prompts: dict[int, PromptInfo] = {}

    async def choice(self, i: int, parsed: bool = False) -> _Choice | _ParsedChoice:
        # Made at its first entry, which says after which prompt ids to decode (or that it is parsed).
        if i not in self.choices:
            if parsed:
                self.choices[i] = _ParsedChoice()
            else:
                tail = self.prompts[i].tail if i in self.prompts else []
                tok, eos = await self.loading
                self.choices[i] = _Choice(IncrementalDetokenizer(tok, tail, self.stops, self.opts),
                                          self.stop_ids | frozenset(eos))
        return self.choices[i]

    def with_usage(self, obj: dict, i: int, prompt: int | None = None, completion: int | None = None) -> dict:
        if self.continuous_usage:
            p = (self.prompts[i].tokens if i in self.prompts else 0) if prompt is None else prompt
            c = len(self.ids.get(i, [])) if completion is None else completion
            obj["usage"] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
        return obj

    async def push(self, entries: list) -> list[bytes]:
        """The chunks of new text (or delta messages) in these stream entries."""
        out = []
        deltas: dict[int, list[dict]] = {}
        ended: set[int] = set()
        for i, new in apply_entries(entries, self.ids, self.prompts, deltas, ended).items():
            if i >= self.n_choices:
                continue
            c = await self.choice(i, parsed=i in deltas)
            if isinstance(c, _ParsedChoice):
                out += [sse(self.with_usage(self.chunk(i, d, None), i)) for d in c.relay(deltas.get(i, []))]
                c.ended = c.ended or i in ended
            elif delta := c.push(new):
                out.append(sse(self.with_usage(self.chunk(i, delta, None), i)))
        return out

    async def finish(self, view: JobView, usage_chunk: Callable[[JobView], dict] | None) -> list[bytes]:
        """The last chunks, from the ended job: each choice's rest and finish reason (and the
        usage), or the job's error."""
        if view.status != JobStatus.SUCCEEDED or view.result is None:
            err = view.error
            reason = err.type if err else ErrorReason.EXPIRED if view.status == JobStatus.EXPIRED else ErrorReason.INTERNAL
            return [sse(error_event(reason, err.message if err else f"job {view.status.value}", err.param if err else None))]
        out = []
        for r in view.result.results:
            c = await self.choice(r.index, parsed=r.parsed is not None and r.index not in self.choices)
            tail = c.rest_delta(r)
            calls = isinstance(c, _ParsedChoice) and bool(c.calls or (isinstance(tail, dict) and tail.get("tool_calls")))
            out.append(sse(self.with_usage(self.chunk(r.index, tail, self.finish_of(r, calls)), r.index, r.prompt_tokens,
                                           r.completion_tokens)))
        if usage_chunk is not None:
            out.append(sse(usage_chunk(view)))
        return out


async def stream_job(
    *, job_id: str, n_choices: int, stops: list[str], service: JobService, waiter: JobWaiter,
    streams: TokenStreams, detok: Detokenizer, chunk: ChunkFn, first: list[dict], usage_chunk: Callable[[JobView], dict] | None,
    deadline: float, continuous_usage: bool = False, stop_ids: Iterable[int] = (), opts: Detokenizing | None = None,
    ignore_eos: bool = False, finish: FinishFn | None = None,
) -> AsyncIterator[bytes]:
    """``continuous_usage``: vLLM's ``stream_options.continuous_usage_stats``, every chunk
    carries the usage so far. ``stop_ids``: the request's stop_token_ids; they and the
    model's EOS ids (unless ``ignore_eos``) end the output, without their text (as vLLM). ``opts``: the request's detokenizing options."""
    # The first call reads files: off the event loop, while the stream is already read.
    loading = asyncio.ensure_future(run_in_threadpool(lambda: (detok.tokenizer(), [] if ignore_eos else detok.eos_ids())))
    text = _Choices(loading, n_choices, stops, frozenset(stop_ids), chunk, continuous_usage, opts or Detokenizing(), finish)
    for obj in first:
        yield sse(obj)
    # The job's terminal move appends an end marker to its stream (llmpipe/jobs/store.py), after
    # every token published before the end: the process's one stream reader (api/token_streams.py)
    # hands this response each new entry and the end, with nothing to poll. The record is read
    # when the marker came and, as a safety net, when the stream stayed silent for FALLBACK_S
    # or the waiter woke (its reconnects; a record that ended without a marker).
    async with waiter.watch(job_id) as woken, streams.follow(job_id) as tokens:
        view: JobView | None = None
        while True:
            wait_s = max(0.001, min(FALLBACK_S, deadline + 5 - time.time()))
            entries = await tokens.next(wait_s)
            marked = any(is_end(f) for _, f in entries)
            for part in await text.push(entries):
                yield part
            if marked or not entries or woken.is_set():
                woken.clear()
                view = await run_in_threadpool(service.view, job_id, False)
                if view.status.terminal:
                    if not marked:  # ended without a marker: what the stream holds is all there is
                        for part in await text.push(await streams.rest(tokens)):
                            yield part
                    break  # the marker follows every token published before the end
            if time.time() > deadline + 5:
                break  # nothing ended the job; it is settled expired below
    for part in await text.finish(await _settled(service, job_id, view), usage_chunk):
        yield part
    yield sse("[DONE]")


async def _settled(service: JobService, job_id: str, view: JobView | None) -> JobView:
    """The ended job: the view read last, or a job that did not end by its deadline expired."""
    if view is None:
        view = await run_in_threadpool(service.view, job_id, False)
    if not view.status.terminal:  # (an ended record never changes: no need to read it again)
        await run_in_threadpool(service.expire, job_id, "the job did not finish by its deadline")
        view = await run_in_threadpool(service.view, job_id, False)
    return view


class JobStream(StreamingResponse):
    """An SSE response that cancels its job when the client goes away before the end.

    Starlette cancels the response's task when it sees ``http.disconnect``, so cleanup in
    the generator would run inside a cancelled scope and never finish (the old defect).
    Here it runs after the response, shielded: the generator is closed (its watch ends) and,
    unless it reached ``[DONE]``, ``on_abandon`` cancels the job."""

    def __init__(self, content: AsyncIterator[bytes], *, on_abandon: Callable[[], None], **kwargs):
        self._inner = content
        self._on_abandon = on_abandon
        self.completed = False
        super().__init__(self._tracked(), **kwargs)

    async def _tracked(self) -> AsyncIterator[bytes]:
        try:
            async for part in self._inner:
                yield part
            self.completed = True
        finally:
            await self._inner.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.move_on_after(10, shield=True):
                try:
                    await self.body_iterator.aclose()
                except Exception:
                    log.debug("closing an SSE generator failed", exc_info=True)
                if not self.completed:
                    try:
                        await run_in_threadpool(self._on_abandon)
                    except Exception:
                        log.warning("could not cancel a job after its client disconnected", exc_info=True)
