"""A streaming job's end wakes its SSE reader: the record's terminal move appends an end
marker to the job's token stream, and the reader blocks on the stream instead of polling."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

from api.detok import Detokenizer
from api.jobs.protocol import JobView
from api.openai.sse import FALLBACK_S, stream_job
from llmpipe.jobs.store import JobStore
from llmpipe.jobs.streaming import apply_entries, is_end, stream_key
from llmpipe.messages import JobResult, JobStatus


def _result(job_id: str, text: str) -> JobResult:
    return JobResult.model_validate({
        "job_id": job_id, "status": "succeeded", "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
        "results": [{"index": 0, "text": text, "finish_reason": "length", "completion_tokens": 2}]})


def test_terminal_moves_of_a_streaming_job_mark_the_end_of_its_stream(redis_client):
    store = JobStore(redis_client, 60)
    store.create("s1", n_prompts=1, deadline=time.time() + 60, stream=True)
    store.create("n1", n_prompts=1, deadline=time.time() + 60)
    redis_client.xadd(stream_key("s1"), {"i": 0, "o": 0, "d": "[5]"})
    assert store.finish(_result("s1", "x")) and store.finish(_result("n1", "x"))
    entries = redis_client.xrange(stream_key("s1"))
    assert [is_end(f) for _, f in entries] == [False, True]
    assert entries[-1][1] == {b"e": b"succeeded"}
    assert 0 < redis_client.ttl(stream_key("s1")) <= 900
    assert apply_entries(entries, {}) == {0: [5]}  # readers of ids skip the marker
    assert not redis_client.exists(stream_key("n1"))  # nobody streams it: no marker
    # A cancel (and an expiry) ends the stream the same way; a second terminal move adds nothing.
    store.create("s2", n_prompts=1, deadline=time.time() + 60, stream=True)
    assert store.stop("s2", JobStatus.CANCELLED, {"type": "cancelled", "message": "x"})
    assert not store.stop("s2", JobStatus.EXPIRED, {"type": "expired", "message": "x"})
    assert [f for _, f in redis_client.xrange(stream_key("s2"))] == [{b"e": b"cancelled"}]


class _Streams:
    """The process's stream reader, as the response sees it: tokens, then the end marker;
    records how long each wait could last."""

    def __init__(self, replies):
        self.replies = list(replies)
        self.waits: list[float] = []

    @contextlib.asynccontextmanager
    async def follow(self, job_id):
        yield self

    async def next(self, timeout):
        self.waits.append(timeout)
        return self.replies.pop(0) if self.replies else []


class _Service:
    def __init__(self, view):
        self.views = 0
        self._view = view

    def view(self, job_id, partial=True):
        self.views += 1
        return self._view


class _Waiter:
    @contextlib.asynccontextmanager
    async def watch(self, job_id):
        yield asyncio.Event()


def test_the_reader_blocks_on_the_stream_and_ends_at_the_marker(tiny_model):
    tok = Detokenizer(tiny_model)
    ids = tok.tokenizer().encode("Hello world", add_special_tokens=False).ids
    replies = [[(b"1-0", {b"i": b"0", b"o": b"0", b"d": json.dumps(ids).encode()})], [(b"2-0", {b"e": b"succeeded"})]]
    r = _Streams(replies)
    done = JobView(id="j", status=JobStatus.SUCCEEDED, created_at=0.0, deadline=time.time() + 60, prompts=1,
                   result=_result("j", tok.decode(ids)))
    service = _Service(done)

    async def run():
        out = []
        async for part in stream_job(job_id="j", n_choices=1, stops=[], service=service, waiter=_Waiter(), streams=r,
                                     detok=tok, chunk=lambda i, t, f: {"text": t, "finish": f}, first=[],
                                     usage_chunk=None, deadline=time.time() + 60):
            out.append(part.decode())
        return out

    out = asyncio.run(run())
    texts = [json.loads(p[6:])["text"] for p in out if p.startswith("data: {")]
    assert "".join(texts) == tok.decode(ids) and out[-1] == "data: [DONE]\n\n"
    # Two waits, each until something arrives (never a short poll), and the record read
    # once, when the marker came.
    assert len(r.waits) == 2 and all(w >= FALLBACK_S - 0.1 for w in r.waits)
    assert service.views == 1


def test_a_streams_first_tokens_are_due_at_once_and_a_non_stream_finish_publishes_nothing(redis_client):
    from llmpipe.jobs.streaming import TokenPublisher

    now = [100.0]
    pub = TokenPublisher(redis_client, flush_s=60, partial_every_s=60, clock=lambda: now[0])
    try:
        pub.register("f-0", "f", 0, True, prompt_tokens=3, prompt_tail=[1])
        pub.register("f-1", "f", 1, False)
        pub.on_tokens("f-0", [7])
        pub.on_tokens("f-1", [8])
        assert pub.flush() == 1  # the stream's first tokens, without waiting flush_s; not the other's
        pub.on_tokens("f-0", [7, 9])
        assert pub.flush() == 0  # later ones wait for flush_s
        pub.finish("f-1")  # nobody streams it: its end publishes nothing (its result follows)
        assert apply_entries(redis_client.xrange(stream_key("f")), {}) == {0: [7]}
    finally:
        pub.close()
