"""The load generator's OpenAI-protocol client, in the four OpenAI request kinds
(llmpipe/bench/kinds.py); a streamed answer's first chunk with text gives the TTFT.

``vllm serve`` and the pipeline's API (and the serial server's completions) are driven with
the same bodies: the prompt as the completion's ``prompt`` or as the chat's one user
message, ``max_tokens``, temperature 0 and ``ignore_eos``, so that every request generates
exactly ``max_tokens`` tokens on both servers.
"""

from __future__ import annotations

import json
import time

import httpx

from llmpipe.bench.kinds import STREAMING, endpoint
from llmpipe.bench.loadgen import Sample


def job_id_of(response_id: str) -> str | None:
    """The pipeline's job id in an OpenAI answer's ``id`` (``cmpl-<job>``, ``chatcmpl-<job>``)."""
    for prefix in ("chatcmpl-", "cmpl-"):
        if response_id.startswith(prefix):
            return response_id.removeprefix(prefix)
    return None


def chunk_text(chunk: dict) -> str:
    """The text a streamed chunk carries: a completion's ``text``, a chat delta's ``content``."""
    return "".join((c.get("text") or (c.get("delta") or {}).get("content") or "") for c in chunk.get("choices") or ())


class OpenAIClient:
    protocol = "openai"

    def __init__(self, base_url: str, max_tokens: int, model: str, *, stream: bool = True, chat: bool = False):
        self.base = base_url.rstrip("/")
        self.max_tokens = max_tokens
        self.model = model
        self.stream = stream
        self.chat = chat

    @classmethod
    def of_kind(cls, kind: str, base_url: str, max_tokens: int, model: str) -> OpenAIClient:
        if endpoint(kind) == "jobs":
            raise ValueError("the jobs kind is the job API's (loadgen.JobsClient)")
        return cls(base_url, max_tokens, model, stream=kind in STREAMING, chat=endpoint(kind) == "chat")

    @property
    def kind(self) -> str:
        return ("chat" if self.chat else "completions") + ("-stream" if self.stream else "")

    @property
    def url(self) -> str:
        return f"{self.base}/v1/chat/completions" if self.chat else f"{self.base}/v1/completions"

    def body(self, prompt: str) -> dict:
        b = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0.0, "ignore_eos": True,
             "stream": self.stream}
        if self.chat:
            b["messages"] = [{"role": "user", "content": prompt}]
        else:
            b["prompt"] = prompt
        if self.stream:
            b["stream_options"] = {"include_usage": True}
        return b

    async def request(self, http: httpx.AsyncClient, s: Sample, prompt: str) -> None:
        if self.stream:
            await self._streamed(http, s, self.body(prompt))
            return
        r = await http.post(self.url, json=self.body(prompt))
        if r.status_code != 200:
            s.error = f"POST {r.status_code}: {r.text[:200]}"
            return
        answer = r.json()
        job = job_id_of(str(answer.get("id", "")))
        if job:
            s.extra["job_id"] = job
        s.completion_tokens = int((answer.get("usage") or {}).get("completion_tokens", 0))
        s.ok = True

    async def _streamed(self, http: httpx.AsyncClient, s: Sample, body: dict) -> None:
        t0 = time.perf_counter()
        chunks = 0
        usage = None
        async with http.stream("POST", self.url, json=body) as r:
            if r.status_code != 200:
                s.error = f"POST {r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    s.extra["done_at"] = time.time()  # epoch s: the stream's end, against the job's
                    break
                chunk = json.loads(data)
                if "job_id" not in s.extra and (job := job_id_of(str(chunk.get("id", "")))):
                    s.extra["job_id"] = job
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk_text(chunk):
                    chunks += 1
                    if s.ttft_s is None:
                        s.ttft_s = time.perf_counter() - t0
        s.completion_tokens = int(usage["completion_tokens"]) if usage else chunks
        s.ok = True
