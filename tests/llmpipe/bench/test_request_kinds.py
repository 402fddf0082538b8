"""The four OpenAI request kinds of the load generator (llmpipe/bench/openai_client.py), and
which kinds each mode of a plan takes (llmpipe/bench/runner.py EnginePlan.kinds_for)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from llmpipe.bench.kinds import JOBS, KINDS, endpoint
from llmpipe.bench.loadgen import Sample
from llmpipe.bench.modes import MODES, EngineSetup
from llmpipe.bench.openai_client import OpenAIClient, chunk_text, job_id_of
from llmpipe.bench.runner import EnginePlan, Load
from llmpipe.settings import EngineKind


class FakeOpenAI:
    """An OpenAI server in the transport: records each body, answers 3 tokens of text."""

    def __init__(self):
        self.seen: list[tuple[str, dict]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.seen.append((request.url.path, body))
        chat = request.url.path.endswith("/chat/completions")
        rid = ("chatcmpl-" if chat else "cmpl-") + "job42"
        if not body["stream"]:
            choice = {"message": {"role": "assistant", "content": "a b c"}} if chat else {"text": "a b c"}
            return httpx.Response(200, json={"id": rid, "choices": [choice], "usage": {"completion_tokens": 3}})
        lines = []
        for piece in ("a", " b", " c"):
            choice = {"delta": {"content": piece}} if chat else {"text": piece}
            lines.append(f"data: {json.dumps({'id': rid, 'choices': [choice]})}")
        lines += [f"data: {json.dumps({'id': rid, 'choices': [], 'usage': {'completion_tokens': 3}})}", "data: [DONE]"]
        return httpx.Response(200, text="\n\n".join(lines) + "\n\n", headers={"content-type": "text/event-stream"})


def _send(kind: str) -> tuple[Sample, tuple[str, dict]]:
    fake = FakeOpenAI()

    async def go() -> Sample:
        s = Sample(i=0, start=0.0)
        async with httpx.AsyncClient(transport=httpx.MockTransport(fake)) as http:
            await OpenAIClient.of_kind(kind, "http://server", 3, "the-model").request(http, s, "hello there")
        return s

    return asyncio.run(go()), fake.seen[0]


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_posts_its_endpoint_and_reads_its_answer(kind):
    s, (path, body) = _send(kind)
    chat, stream = kind.startswith("chat"), kind.endswith("-stream")
    assert path == ("/v1/chat/completions" if chat else "/v1/completions")
    assert body["stream"] is stream and body["max_tokens"] == 3 and body["ignore_eos"] is True
    assert body["temperature"] == 0.0 and body["model"] == "the-model"
    if chat:
        assert body["messages"] == [{"role": "user", "content": "hello there"}] and "prompt" not in body
    else:
        assert body["prompt"] == "hello there" and "messages" not in body
    assert ("stream_options" in body) is stream
    assert s.ok and s.error is None and s.completion_tokens == 3
    assert (s.ttft_s is not None) is stream  # a TTFT only where the answer streams
    assert s.extra["job_id"] == "job42"  # the pipeline's job, read back for its stage timings


def test_a_refused_request_is_an_error_sample():
    async def go() -> Sample:
        s = Sample(i=0, start=0.0)
        transport = httpx.MockTransport(lambda r: httpx.Response(429, json={"error": "busy"}))
        async with httpx.AsyncClient(transport=transport) as http:
            await OpenAIClient.of_kind("chat", "http://server", 3, "m").request(http, s, "p")
        return s

    s = asyncio.run(go())
    assert not s.ok and s.error.startswith("POST 429")


def test_kind_names_and_ids():
    assert [endpoint(k) for k in KINDS] == ["completions", "completions", "chat", "chat"]
    assert endpoint(JOBS) == JOBS
    with pytest.raises(ValueError):
        endpoint("embeddings")
    with pytest.raises(ValueError):
        OpenAIClient.of_kind(JOBS, "http://server", 3, "m")
    assert job_id_of("chatcmpl-abc") == "abc" and job_id_of("cmpl-abc") == "abc" and job_id_of("x-abc") is None
    assert chunk_text({"choices": [{"delta": {"content": "hi"}}]}) == "hi"
    assert chunk_text({"choices": [{"text": "hi"}]}) == "hi" and chunk_text({"choices": []}) == ""


def _plan(api: str, kinds: list[str]) -> EnginePlan:
    setup = EngineSetup(key="real", kind=EngineKind.VLLM, label="real", model_path="/m", max_model_len=None)
    return EnginePlan(setup, 128, 32, [(m, [Load(concurrency=1)]) for m in MODES], api=api, kinds=kinds)


def test_modes_take_the_kinds_their_servers_answer():
    p = _plan("openai", list(KINDS))
    for mode in ("pipeline-window50", "vllm-serve", "vllm-serve-matched"):
        assert p.kinds_for(MODES[mode]) == list(KINDS)
    assert p.kinds_for(MODES["serial"]) == ["completions-stream", "completions"]  # no chat endpoint
    assert p.kinds_for(MODES["celery-floor"]) == [JOBS]  # the job API only
    jobs = _plan("jobs", ["completions-stream"])
    assert jobs.kinds_for(MODES["pipeline-window50"]) == [JOBS] and jobs.kinds_for(MODES["serial"]) == [JOBS]
    assert jobs.kinds_for(MODES["vllm-serve"]) == ["completions-stream"]  # vllm serve has no job API
