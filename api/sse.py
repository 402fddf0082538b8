"""Server-sent events for ``stream: true``: token deltas from the job's Redis stream."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable

import redis.asyncio as aioredis
from starlette.concurrency import run_in_threadpool

from api.detok import Detokenizer, IncrementalText
from api.jobs import JobService
from api.schemas import JobView
from api.streams import apply_entries
from api.waiter import JobWaiter
from llmpipe.messages import JobStatus
from llmpipe.streaming import stream_key

log = logging.getLogger("llmpipe.api")

# chunk(index, text_delta, finish_reason) -> the OpenAI chunk object for one choice
ChunkFn = Callable[[int, str, str | None], dict]


def sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n".encode()


class _Choice:
    """Streamed text of one choice, cut at the first stop string. Holds back as many
    characters as the longest stop string, less one, so a stop is never half sent."""

    def __init__(self, detok: Detokenizer, stops: list[str]):
        self.inc = IncrementalText(detok)
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""  # all text decoded so far
        self.sent = 0
        self.stopped = False

    def push(self, ids: list[int]) -> str:
        if self.stopped:
            return ""
        self.text += self.inc.push(ids)
        cut = min((i for i in (self.text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            upto = cut
        else:
            upto = max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:upto], upto
        return out

    def rest(self, final_text: str) -> str:
        """What the final result adds beyond what was sent."""
        if final_text.startswith(self.text[: self.sent]) and len(final_text) > self.sent:
            out = final_text[self.sent:]
            self.sent = len(final_text)
            return out
        return ""


async def stream_job(
    *, job_id: str, n_choices: int, stops: list[str], service: JobService, waiter: JobWaiter,
    aredis: aioredis.Redis, detok: Detokenizer, chunk: ChunkFn, first: list[dict], usage_chunk: Callable[[JobView], dict] | None,
    deadline: float, on_abandon: Callable[[], None], continuous_usage: bool = False,
) -> AsyncIterator[bytes]:
    choices = [_Choice(detok, stops) for _ in range(n_choices)]
    ids: dict[int, list[int]] = {}
    prompt_tokens: dict[int, int] = {}

    def with_usage(obj: dict, i: int, prompt: int | None = None, completion: int | None = None) -> dict:
        # vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far.
        if continuous_usage:
            p = prompt_tokens.get(i, 0) if prompt is None else prompt
            c = len(ids.get(i, [])) if completion is None else completion
            obj["usage"] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
        return obj

    last = "0-0"
    finished = False
    try:
        for obj in first:
            yield sse(obj)
        async with waiter.watch(job_id) as done:
            # The job may have finished before the watch began: its PUBLISH is gone.
            if (await run_in_threadpool(service.view, job_id, False)).status.terminal:
                done.set()
            while True:
                is_done = done.is_set()
                resp = await aredis.xread({stream_key(job_id): last}, count=256, block=None if is_done else 50)
                for _, entries in resp or []:
                    last = entries[-1][0]
                    for i, new in apply_entries(entries, ids, prompt_tokens).items():
                        if i < n_choices:
                            delta = choices[i].push(new)
                            if delta:
                                yield sse(with_usage(chunk(i, delta, None), i))
                if is_done and not resp:
                    break
                if not is_done and time.time() > deadline + 5:
                    break  # the watchdog settles the job; stop waiting for it here
        view = await run_in_threadpool(service.view, job_id, False)
        finished = True
        if view.status == JobStatus.SUCCEEDED and view.result is not None:
            for r in view.result.results:
                c = choices[r.index]
                tail = c.rest(r.text)
                yield sse(with_usage(chunk(r.index, tail, r.finish_reason.value), r.index, r.prompt_tokens,
                                     r.completion_tokens))
            if usage_chunk is not None:
                yield sse(usage_chunk(view))
        else:
            err = view.error
            yield sse({"error": {"type": (err.type.value if err else view.status.value),
                                 "message": err.message if err else f"job {view.status.value}"}})
        yield sse("[DONE]")
    finally:
        if not finished:
            # The client went away: like vLLM, stop generating for it.
            try:
                await run_in_threadpool(on_abandon)
            except Exception:
                log.warning("job=%s could not cancel after disconnect", job_id, exc_info=True)
