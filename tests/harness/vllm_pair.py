"""Two servers of the same engine side by side, for the conformance tests
(tests/integration/test_vllm_conformance*.py): ``vllm serve`` (vLLM's own OpenAI server,
started through llmpipe's version shim) and an llmpipe pipeline with the vllm engine, on
the tiny model with the same max_model_len, seed and parsers (vLLM's hermes tool parser
with auto tool choice, its qwen3 reasoning parser, request chat templates trusted). The
pair runs on a Redis of its own and is shared by the modules that use it
(tests/harness/shared.py); the helpers send one request to both and compare the answers."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx

from llmpipe.local.redis_server import EmbeddedRedis, free_port
from llmpipe.local.supervisor import Supervisor, python_env
from tests.harness.engine import KV_CACHE_GIB
from tests.harness.stacks import start_pipeline, teardown

PAIR_KEY = ("vllm-serve pair",)
MAX_LEN = 512
TOL = 1e-4
PARSER_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                "--trust-request-chat-template"]
PARSERS = dict(enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3",
               trust_request_chat_template=True)
# The KV cache is the pipeline's size (tests/harness/engine.py), given as a flag: no VLLM_CPU_KVCACHE_SPACE.
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_HOST_IP": "127.0.0.1",
            "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


class Servers(tuple):
    """(llmpipe URL, vllm serve URL); ``log_dir``: the llmpipe pipeline's log files."""

    log_dir = None


class Pair:
    """``vllm serve`` and an llmpipe pipeline of the tiny model, both ready; ``servers`` are
    their URLs, ``close`` stops both."""

    def __init__(self, tmp: Path, model: str):
        self.sup = Supervisor(tmp / "vllm-logs", echo=False)
        self.redis_server = EmbeddedRedis(tmp / "redis", appendonly=False).start()
        self.pipe = None
        try:
            port = free_port()
            # vLLM's server, through the version shim (it must start this way).
            self.sup.spawn("vllm-serve", [sys.executable, "-m", "llmpipe.cli.vllm", "serve", model, "--port", str(port),
                                          "--host", "127.0.0.1", "--enforce-eager", "--dtype", "float32", "--seed", "0",
                                          "--max-model-len", str(MAX_LEN), "--max-num-seqs", "16", *PARSER_FLAGS,
                                          "--kv-cache-memory-bytes", str(int(KV_CACHE_GIB * 2**30))],
                           python_env(VLLM_ENV))
            self.pipe = start_pipeline(tmp / "pipe", self.redis_server.url, model, "vllm", max_model_len=MAX_LEN,
                                       **PARSERS)
            vllm_url = f"http://127.0.0.1:{port}"
            self._wait_healthy(vllm_url)
        except BaseException:
            self.close()
            raise
        self.servers = Servers((self.pipe.api_url, vllm_url))
        self.servers.log_dir = self.pipe.sup.log_dir

    def _wait_healthy(self, url: str, timeout: float = 300) -> None:
        end = time.monotonic() + timeout
        while True:
            dead = self.sup.exited()
            assert not dead, "vllm serve exited:\n" + "\n".join(dead[0].tail[-30:])
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < end, "vllm serve did not become healthy"
            time.sleep(0.5)

    def close(self) -> None:
        try:
            if self.pipe is not None:
                teardown(self.pipe)
        finally:
            self.sup.stop(timeout=30)
            self.redis_server.stop()


def post(base: str, path: str, body: dict) -> httpx.Response:
    """One request to one server (a long timeout: a busy 2-core machine)."""
    return httpx.post(f"{base}{path}", json=body, timeout=300)  # a busy 2-core machine


def both(servers, path: str, body: dict) -> tuple[dict, dict]:
    ours, theirs = (post(base, path, body) for base in servers)
    assert ours.status_code == theirs.status_code == 200, (ours.text[:500], theirs.text[:500])
    return ours.json(), theirs.json()


def close(a, b, where: str = "") -> None:
    """Equal JSON values, floats to TOL."""
    if isinstance(a, float) or isinstance(b, float):
        assert a is not None and b is not None and abs(a - b) <= TOL, f"{where}: {a} != {b}"
    elif isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            close(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


COMPLETION_KEYS = ("index", "text", "finish_reason", "stop_reason", "token_ids", "prompt_token_ids", "logprobs",
                   "prompt_logprobs")


def same_completion(ours: dict, theirs: dict) -> None:
    assert len(ours["choices"]) == len(theirs["choices"])
    for a, b in zip(ours["choices"], theirs["choices"], strict=True):
        for k in COMPLETION_KEYS:
            close(a.get(k), b.get(k), f"choices[{a['index']}].{k}")
    close({k: ours["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
          {k: theirs["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}, "usage")


def tool_calls(message: dict) -> list[tuple[str, str]]:
    """(name, arguments) of each call (ids are random in both)."""
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]


def same_chat(ours: dict, theirs: dict) -> None:
    assert len(ours["choices"]) == len(theirs["choices"])
    for a, b in zip(ours["choices"], theirs["choices"], strict=True):
        for k in ("index", "finish_reason", "stop_reason", "token_ids", "logprobs"):
            close(a.get(k), b.get(k), f"choices[{a['index']}].{k}")
        for k in ("content", "reasoning", "role"):
            close(a["message"].get(k), b["message"].get(k), f"message.{k}")
        assert tool_calls(a["message"]) == tool_calls(b["message"])
    for k in ("prompt_logprobs", "prompt_token_ids"):
        close(ours.get(k), theirs.get(k), k)
    close({k: ours["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
          {k: theirs["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}, "usage")


def stream_text(base: str, body: dict) -> tuple[str, list[dict]]:
    """A streamed completion's text and its chunks."""
    text, chunks = "", []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, (base, r.read())
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
                text += "".join(c.get("text", "") for c in chunks[-1]["choices"])
    return text, chunks


def chat_stream(base: str, body: dict) -> dict:
    """A streamed chat answer as a client accumulates it: per choice the content, reasoning,
    tool calls (name, arguments by index) and finish reason."""
    out: dict[int, dict] = {}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                acc = out.setdefault(c["index"], {"content": "", "reasoning": "", "calls": {}, "finish": None})
                d = c["delta"]
                acc["content"] += d.get("content") or ""
                acc["reasoning"] += d.get("reasoning") or ""
                for t in d.get("tool_calls") or []:
                    call = acc["calls"].setdefault(t["index"], ["", ""])
                    call[0] += (t.get("function") or {}).get("name") or ""
                    call[1] += (t.get("function") or {}).get("arguments") or ""
                acc["finish"] = c["finish_reason"] or acc["finish"]
    return {i: {**a, "calls": [tuple(a["calls"][k]) for k in sorted(a["calls"])]} for i, a in out.items()}


def as_streamed(answer: dict) -> dict:
    """A non-streamed chat answer in chat_stream's shape."""
    return {c["index"]: {"content": c["message"]["content"] or "", "reasoning": c["message"].get("reasoning") or "",
                         "calls": tool_calls(c["message"]), "finish": c["finish_reason"]} for c in answer["choices"]}


def both_chat(servers, body: dict) -> dict:
    """The same chat request to both, plain and streamed: the same answers, each stream
    ending equal to its answer (and llmpipe's stream to vLLM's). Returns llmpipe's answer."""
    ours, theirs = both(servers, "/v1/chat/completions", body)
    same_chat(ours, theirs)
    s_ours, s_theirs = (chat_stream(base, body) for base in servers)
    assert s_ours == s_theirs
    # vLLM's stream ends equal to its answer but for an output cut inside a tool call (the
    # stream sent the call's start, the answer has none): llmpipe's then is vLLM's stream.
    if s_theirs == as_streamed(theirs):
        assert s_ours == as_streamed(ours)
    return ours


def token_ids(servers, tiny_model, prompt: str, n: int, **kw) -> list[int]:
    """The token ids both give for ``prompt`` at temperature 0 (after checking they agree)."""
    ref, _ = both(servers, "/v1/completions", {"model": tiny_model, "prompt": prompt, "max_tokens": n, "temperature": 0,
                                                "return_token_ids": True, **kw})
    return ref["choices"][0]["token_ids"]


def same_error(servers, model: str, path: str, body: dict) -> None:
    """The same bad request to both: the same 400 or 404 status, and vLLM's error shape."""
    body = {"model": model, **body}
    ours, theirs = (post(base, path, body) for base in servers)
    assert ours.status_code == theirs.status_code and ours.status_code in (400, 404), (ours.text, theirs.text)
    a, b = ours.json()["error"], theirs.json()["error"]
    assert {"message", "type", "param", "code"} <= a.keys() and {"message", "type", "param", "code"} <= b.keys()
    assert a["code"] == b["code"] == ours.status_code and a["message"]
    if b["param"] is not None:  # vLLM names the field: so do we (its validation errors say "body.<field>")
        assert a["param"] == b["param"].removeprefix("body."), (a, b)
