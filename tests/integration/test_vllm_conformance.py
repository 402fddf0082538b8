"""llmpipe as a drop-in for ``vllm serve``: the same requests to both, on the tiny model at
temperature 0 (or with a seed), answer the same. Token ids, text, logprobs (to 1e-4), finish
and stop reasons, usage, the error shapes of bad fields, and the endpoints vLLM's clients
probe; every sampling field, guided decoding, tool calls, the split of reasoning from
content and the chat template's fields, plain and streamed (the accumulated stream).

Both servers start here: ``python -m llmpipe.cli.vllm serve`` (vLLM's own OpenAI server)
and an llmpipe pipeline with the vllm engine, with the same max_model_len and seed, and the
same parsers: vLLM's hermes tool parser with auto tool choice and its qwen3 reasoning
parser (``--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3``),
and request chat templates trusted. The qwen3 parser makes a chat output reasoning until
``</think>`` (all of it, on a random model) unless ``chat_template_kwargs`` turn thinking
off; the tests that want content say so."""

from __future__ import annotations

import json
import sys
import time

import httpx
import pytest

from llmpipe.local.redis_server import free_port
from tests.harness.stacks import teardown

pytestmark = pytest.mark.integration

MAX_LEN = 512
TOL = 1e-4
PARSER_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                "--trust-request-chat-template"]
PARSERS = dict(enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3",
               trust_request_chat_template=True)


class Servers(tuple):
    """(llmpipe URL, vllm serve URL); ``log_dir``: the llmpipe pipeline's log files."""

    log_dir = None


@pytest.fixture(scope="module")
def servers(tmp_path_factory, redis_server, tiny_model, pipeline_starter):
    """(llmpipe URL, vllm serve URL), each started once for the module."""
    import redis

    from llmpipe.local.supervisor import Supervisor, python_env

    tmp = tmp_path_factory.mktemp("conformance")
    port = free_port()
    sup = Supervisor(tmp / "vllm-logs", echo=False)
    # vLLM's server, through the version shim (issue 15, item 5: it must start this way).
    sup.spawn("vllm-serve", [sys.executable, "-m", "llmpipe.cli.vllm", "serve", tiny_model, "--port", str(port),
                             "--host", "127.0.0.1", "--enforce-eager", "--dtype", "float32", "--seed", "0",
                             "--max-model-len", str(MAX_LEN), "--max-num-seqs", "16", *PARSER_FLAGS],
              python_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                          "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}))
    redis.Redis.from_url(redis_server.url).flushdb()
    pipe = None
    try:
        pipe = pipeline_starter(tmp / "pipe", redis_server.url, tiny_model, "vllm", max_model_len=MAX_LEN, **PARSERS)
        vllm_url = f"http://127.0.0.1:{port}"
        end = time.monotonic() + 300
        while True:
            dead = sup.exited()
            assert not dead, "vllm serve exited:\n" + "\n".join(dead[0].tail[-30:])
            try:
                if httpx.get(f"{vllm_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < end, "vllm serve did not become healthy"
            time.sleep(0.5)
        both_servers = Servers((pipe.api_url, vllm_url))
        both_servers.log_dir = pipe.sup.log_dir
        yield both_servers
    finally:
        if pipe is not None:
            teardown(pipe)
        sup.stop(timeout=30)


def _post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, timeout=300)  # a busy 2-core machine


def both(servers, path: str, body: dict) -> tuple[dict, dict]:
    ours, theirs = (_post(base, path, body) for base in servers)
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


def test_text_prompt_with_logprobs(servers, tiny_model):
    body = {"model": tiny_model, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0,
            "logprobs": 3, "return_token_ids": True}
    ours, theirs = both(servers, "/v1/completions", body)
    same_completion(ours, theirs)
    assert len(ours["choices"][0]["logprobs"]["tokens"]) == 12


def test_batched_token_id_prompts_with_n(servers, tiny_model):
    # n > 1 samples (vLLM refuses it at temperature 0); choice k draws with seed + k in both.
    body = {"model": tiny_model, "prompt": [[262, 290, 83, 779], [17, 300, 301, 302, 900]], "max_tokens": 6,
            "temperature": 0.8, "top_p": 0.9, "seed": 7, "n": 2, "logprobs": 0, "return_token_ids": True}
    ours, theirs = both(servers, "/v1/completions", body)
    assert len(ours["choices"]) == 4
    same_completion(ours, theirs)
    single = {**body, "prompt": [262, 290, 83, 779], "n": 1, "temperature": 0}
    same_completion(*both(servers, "/v1/completions", single))


def test_echo_with_logprobs_scores_the_prompt(servers, tiny_model):
    for prompt in ("Paris is a city in", [262, 290, 83, 779, 1864]):
        body = {"model": tiny_model, "prompt": prompt, "max_tokens": 3, "temperature": 0, "logprobs": 2, "echo": True}
        ours, theirs = both(servers, "/v1/completions", body)
        same_completion(ours, theirs)
        lp = ours["choices"][0]["logprobs"]
        assert lp["token_logprobs"][0] is None and all(x is not None for x in lp["token_logprobs"][1:])
        assert ours["choices"][0]["prompt_logprobs"][0] is None


def test_echo_without_generation_scores_the_prompt_only(servers, tiny_model):
    body = {"model": tiny_model, "prompt": "Paris is a city in", "max_tokens": 0, "temperature": 0, "logprobs": 1,
            "echo": True}
    ours, theirs = both(servers, "/v1/completions", body)
    same_completion(ours, theirs)
    assert ours["choices"][0]["text"] == "Paris is a city in"


def test_stream_echo_sends_the_prompt_first(servers, tiny_model):
    body = {"model": tiny_model, "prompt": [262, 290, 83, 779], "max_tokens": 5, "temperature": 0, "echo": True,
            "stream": True}
    (t1, _), (t2, _) = (_stream(base, body) for base in servers)
    assert t1 == t2 and t1.startswith("hello there")


def test_stop_strings_and_stop_token_ids(servers, tiny_model):
    base = {"model": tiny_model, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0,
            "return_token_ids": True}
    ref, _ = both(servers, "/v1/completions", base)
    text, ids = ref["choices"][0]["text"], ref["choices"][0]["token_ids"]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    ours, theirs = both(servers, "/v1/completions", {**base, "stop": [stop, "zzzz"]})
    same_completion(ours, theirs)
    assert ours["choices"][0]["finish_reason"] == "stop" and ours["choices"][0]["stop_reason"] == stop
    assert ours["usage"]["completion_tokens"] < 16
    ours, theirs = both(servers, "/v1/completions", {**base, "stop_token_ids": [ids[3]]})
    same_completion(ours, theirs)
    assert ours["choices"][0]["stop_reason"] == ids[3] and ours["choices"][0]["token_ids"][-1] == ids[3]


def test_chat_with_logprobs_and_top_logprobs(servers, tiny_model):
    body = {"model": tiny_model, "messages": [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Name a colour."}],
            "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 2, "return_token_ids": True}
    ours, theirs = both(servers, "/v1/chat/completions", body)
    same_chat(ours, theirs)
    assert all(len(c["top_logprobs"]) == 2 for c in ours["choices"][0]["logprobs"]["content"])


def test_response_format_json(servers, tiny_model):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}):
        body = {"model": tiny_model, "prompt": "JSON:", "max_tokens": 10, "temperature": 0, "response_format": fmt,
                "return_token_ids": True}
        same_completion(*both(servers, "/v1/completions", body))


def _stream(base: str, body: dict) -> tuple[str, list[dict]]:
    text, chunks = "", []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, (base, r.read())
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
                text += "".join(c.get("text", "") for c in chunks[-1]["choices"])
    return text, chunks


def test_stream_with_continuous_usage(servers, tiny_model):
    body = {"model": tiny_model, "prompt": "Hello", "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    (t1, c1), (t2, c2) = (_stream(base, body) for base in servers)
    assert t1 == t2
    assert all("usage" in c for c in c1)  # every chunk, as vLLM (the chunking itself differs)
    close(c1[-1]["usage"], {k: c2[-1]["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")})
    assert [c["usage"]["completion_tokens"] for c in c1] == sorted(c["usage"]["completion_tokens"] for c in c1)


BAD = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "logprobs": -2}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "logprobs": 50}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "x"}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "response_format": {"type": "json_schema"}}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "prompt_logprobs": 1, "stream": True}),
    ("/v1/completions", {"prompt": "", "max_tokens": 4}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}),
    ("/v1/completions", {"prompt": [1, 2, 99999], "max_tokens": 4}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "model": "not-this-model"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 30}),
]


@pytest.mark.parametrize("path,body", BAD, ids=[json.dumps(b)[:60] for _, b in BAD])
def test_bad_fields_get_the_same_status_and_error_shape(servers, tiny_model, path, body):
    body = {"model": tiny_model, **body}
    ours, theirs = (_post(base, path, body) for base in servers)
    assert ours.status_code == theirs.status_code and ours.status_code in (400, 404), (ours.text, theirs.text)
    a, b = ours.json()["error"], theirs.json()["error"]
    assert {"message", "type", "param", "code"} <= a.keys() and {"message", "type", "param", "code"} <= b.keys()
    assert a["code"] == b["code"] == ours.status_code and a["message"]
    if b["param"] is not None:  # vLLM names the field: so do we (its validation errors say "body.<field>")
        assert a["param"] == b["param"].removeprefix("body."), (a, b)


def test_probe_endpoints(servers, tiny_model):
    for base in servers:
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
        assert httpx.get(f"{base}/ping", timeout=10).status_code == 200
        assert httpx.post(f"{base}/ping", timeout=10).status_code == 200
        assert isinstance(httpx.get(f"{base}/version", timeout=10).json()["version"], str)
    ours, theirs = (httpx.get(f"{base}/version", timeout=10).json()["version"] for base in servers)
    assert ours == theirs  # the engine's vLLM version
    for body in ({"prompt": "hello there", "return_token_strs": True},
                 {"prompt": "hello", "add_special_tokens": False},
                 {"messages": [{"role": "user", "content": "hi"}]},
                 {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False}):
        close(*both(servers, "/tokenize", {"model": tiny_model, **body}), "tokenize")
    for tokens in ([3, 262, 290], [262, 290, 83, 779]):
        close(*both(servers, "/detokenize", {"model": tiny_model, "tokens": tokens}), "detokenize")


SECRET = "Zanzibar quokka marmalade 7391"


def test_no_prompt_or_generated_text_in_any_log_file(servers, tiny_model, tiny_tokenizer):
    """Issue 15: nothing a user sent or got back is logged at INFO, in any process; the
    postprocess stage logs one line per job with its counts and times."""
    from llmpipe.celery_app import root_is_expected

    ours = servers[0]
    ids = tiny_tokenizer(SECRET, add_special_tokens=False)["input_ids"]
    outputs, job_ids = [], []
    for path, body in [
        ("/v1/completions", {"prompt": SECRET, "max_tokens": 12, "temperature": 0, "logprobs": 2, "echo": True}),
        ("/v1/completions", {"prompt": [ids, ids], "max_tokens": 12, "temperature": 0}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": SECRET}], "max_tokens": 12,
                                  "temperature": 0, "logprobs": True, "top_logprobs": 2}),
    ]:
        r = _post(ours, path, {"model": tiny_model, **body}).json()
        job_ids.append(r["id"].split("-", 1)[1])
        outputs += [c.get("text") or c["message"]["content"] or c["message"]["reasoning"] for c in r["choices"]]
    text, _ = _stream(ours, {"model": tiny_model, "prompt": SECRET, "max_tokens": 12, "temperature": 0, "stream": True})
    outputs.append(text)
    job = httpx.post(f"{ours}/v1/jobs", json={"prompt": SECRET, "max_tokens": 12, "temperature": 0}, timeout=30).json()
    outputs.append(httpx.get(f"{ours}/v1/jobs/{job['id']}", params={"wait": 60}, timeout=90).json()["result"]["results"][0]["text"])
    job_ids.append(job["id"])
    assert _post(ours, "/tokenize", {"prompt": SECRET}).status_code == 200

    post_log = servers.log_dir / "postprocess.log"
    end = time.monotonic() + 60
    while not all(f"job={j} " in post_log.read_text() for j in job_ids):  # each job's line is written
        assert time.monotonic() < end, "the postprocess stage did not log every job"
        time.sleep(0.2)
    line = next(x for x in post_log.read_text().splitlines() if f"job={job_ids[0]} " in x)
    assert "prompts=1 tokens_in=" in line and "tokens_out=12" in line and "inf=" in line

    secrets = [SECRET, "quokka", "Zanzibar", ", ".join(map(str, ids)), ",".join(map(str, ids))]
    secrets += [o.strip() for o in outputs if len(o.strip()) >= 8]
    assert len(secrets) > 5
    files = sorted(servers.log_dir.glob("*.log"))
    assert {f.name for f in files} >= {"api.log", "preprocess.log", "inference.log", "postprocess.log"}
    for f in files:
        content = f.read_text(errors="replace")
        leaked = [x for x in secrets if x in content]
        assert not leaked, f"{f.name} holds {leaked[:3]}"
        if root_is_expected(None):  # root in a container: Celery's superuser warning is silenced
            assert "superuser privileges" not in content, f.name


# -- every sampling field, guided decoding, tools, reasoning, the chat template ---------------

def _chat_stream(base: str, body: dict) -> dict:
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


def _as_streamed(answer: dict) -> dict:
    """A non-streamed chat answer in _chat_stream's shape."""
    return {c["index"]: {"content": c["message"]["content"] or "", "reasoning": c["message"].get("reasoning") or "",
                         "calls": tool_calls(c["message"]), "finish": c["finish_reason"]} for c in answer["choices"]}


def both_chat(servers, body: dict) -> dict:
    """The same chat request to both, plain and streamed: the same answers, each stream
    ending equal to its answer (and llmpipe's stream to vLLM's). Returns llmpipe's answer."""
    ours, theirs = both(servers, "/v1/chat/completions", body)
    same_chat(ours, theirs)
    s_ours, s_theirs = (_chat_stream(base, body) for base in servers)
    assert s_ours == s_theirs
    # vLLM's stream ends equal to its answer but for an output cut inside a tool call (the
    # stream sent the call's start, the answer has none): llmpipe's then is vLLM's stream.
    if s_theirs == _as_streamed(theirs):
        assert s_ours == _as_streamed(ours)
    return ours


def _ids(servers, tiny_model, prompt: str, n: int, **kw) -> list[int]:
    ref, _ = both(servers, "/v1/completions", {"model": tiny_model, "prompt": prompt, "max_tokens": n, "temperature": 0,
                                                "return_token_ids": True, **kw})
    return ref["choices"][0]["token_ids"]


def test_sampling_fields(servers, tiny_model):
    prompt = "The weather in Paris is"
    ref = _ids(servers, tiny_model, prompt, 16)
    word = httpx.post(f"{servers[1]}/detokenize", json={"model": tiny_model, "tokens": ref[:1]}, timeout=30).json()["prompt"]
    cases = [{"repetition_penalty": 1.4}, {"presence_penalty": 1.2, "frequency_penalty": 0.6},
             {"logit_bias": {str(ref[0]): -100, "300": 4.5}}, {"allowed_token_ids": [262, 290, 83, 779, 300]},
             {"min_tokens": 12, "stop_token_ids": [ref[2]]}, {"bad_words": [word.strip()]},
             {"temperature": 0.9, "seed": 11, "top_k": 5}, {"temperature": 0.9, "seed": 3, "min_p": 0.2, "top_p": 0.9}]
    changed = 0
    for fields in cases:
        body = {"model": tiny_model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "return_token_ids": True,
                **fields}
        ours, theirs = both(servers, "/v1/completions", body)
        same_completion(ours, theirs)
        changed += ours["choices"][0]["token_ids"] != ref
        stream = {k: v for k, v in body.items() if k != "return_token_ids"}
        (t1, _), (t2, _) = (_stream(base, {**stream, "stream": True}) for base in servers)
        assert t1 == t2 == ours["choices"][0]["text"], fields
    assert changed >= len(cases) - 1  # the fields do something on this model


def test_detokenizing_options(servers, tiny_model):
    # Only special tokens and a few words: the text shows what the options do.
    base = {"model": tiny_model, "prompt": "x", "max_tokens": 14, "temperature": 0, "return_token_ids": True,
            "allowed_token_ids": [0, 3, 4, 262, 290], "ignore_eos": True}
    for fields in ({}, {"skip_special_tokens": False}, {"skip_special_tokens": False, "spaces_between_special_tokens": False},
                   {"stop": ["the"], "include_stop_str_in_output": True}, {"stop": ["the"], "min_tokens": 6}):
        ours, theirs = both(servers, "/v1/completions", {**base, **fields})
        same_completion(ours, theirs)
        stream = {k: v for k, v in {**base, **fields}.items() if k != "return_token_ids"}
        (t1, _), (t2, _) = (_stream(b, {**stream, "stream": True}) for b in servers)
        assert t1 == t2 == ours["choices"][0]["text"], fields
    ours, _ = both(servers, "/v1/completions", {**base, "skip_special_tokens": False})
    assert "<|" in ours["choices"][0]["text"]


def test_truncate_prompt_tokens(servers, tiny_model):
    long = "one two three four five six seven eight nine ten eleven twelve"
    for fields in ({"truncate_prompt_tokens": 5}, {"truncate_prompt_tokens": 5, "truncation_side": "left"},
                   {"truncate_prompt_tokens": -1}):
        for path, body in (("/v1/completions", {"prompt": long}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": long}],
                                                     "chat_template_kwargs": {"enable_thinking": False}})):
            body = {"model": tiny_model, "max_tokens": 6, "temperature": 0, "return_token_ids": True, **body, **fields}
            ours, theirs = both(servers, path, body)
            (same_completion if "prompt" in body else same_chat)(ours, theirs)
            if fields["truncate_prompt_tokens"] == 5:
                assert ours["usage"]["prompt_tokens"] == 5


GUIDED = [({"json": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}, "guided_json"),
          ({"regex": "(yes|no) [a-z]{2,6}"}, "guided_regex"), ({"choice": ["red", "green", "blue"]}, "guided_choice"),
          ({"grammar": 'root ::= "a" ("b" | "c")*'}, "guided_grammar")]


@pytest.mark.parametrize("constraint,older", GUIDED, ids=[o for _, o in GUIDED])
def test_guided_decoding(servers, tiny_model, constraint, older):
    """structured_outputs to both; vLLM's older guided_* name to llmpipe (vLLM 0.32 ignores it,
    llmpipe keeps it as an alias of the same constraint) gives the same tokens."""
    for path, body in (("/v1/completions", {"prompt": "Answer:"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Answer:"}],
                                                 "chat_template_kwargs": {"enable_thinking": False}})):
        body = {"model": tiny_model, "max_tokens": 24, "temperature": 0, "return_token_ids": True, **body}
        ours, theirs = both(servers, path, {**body, "structured_outputs": constraint})
        (same_completion if path == "/v1/completions" else same_chat)(ours, theirs)
        alias = _post(servers[0], path, {**body, older: next(iter(constraint.values()))})
        assert alias.status_code == 200 and alias.json()["choices"][0].get("token_ids") == \
            ours["choices"][0]["token_ids"]


# strict: guided decoding follows the parameters' schema (not just any JSON), so that a call
# on a random model ends within max_tokens.
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "strict": True,
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                                                          "required": ["city"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
             "additionalProperties": False}}}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def no_whitespace(tiny_tokenizer) -> dict:
    """logit_bias against the tokens that are only whitespace: JSON allows any amount between
    its tokens, and a random model takes it, so that a tool call would never end."""
    return {str(i): -100 for i in range(len(tiny_tokenizer)) if tiny_tokenizer.decode([i]) and
            not tiny_tokenizer.decode([i]).strip()}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_through_guided_decoding(servers, tiny_model, no_whitespace, choice):
    body = {"model": tiny_model, "messages": [{"role": "user", "content": "What time is it?"}], "tools": TOOLS,
            "tool_choice": choice, "max_tokens": 120, "temperature": 0, "logit_bias": no_whitespace, **NO_THINKING}
    both_chat(servers, body)  # "required" makes calls until max_tokens: the last one is cut, as in vLLM
    ours = both_chat(servers, {**body, "parallel_tool_calls": False})
    calls = tool_calls(ours["choices"][0]["message"])
    assert len(calls) == 1 and calls[0][0] in ("get_weather", "get_time") and json.loads(calls[0][1])
    if isinstance(choice, dict):
        assert calls[0][0] == "get_time" and json.loads(calls[0][1])["zone"] in ("UTC", "CET")
    else:
        assert ours["choices"][0]["finish_reason"] == "tool_calls"


def test_an_auto_tool_call_is_parsed_from_the_output(servers, tiny_model, no_whitespace):
    """tool_choice auto on a random model: without a constraint the output is content; with a
    regex, vLLM lets the model make a hermes call (its tool-call grammar or the regex), which
    both parse into the same tool call, finish_reason tool_calls."""
    body = {"model": tiny_model, "messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS,
            "max_tokens": 120, "temperature": 0, **NO_THINKING}
    plain = both_chat(servers, body)
    assert tool_calls(plain["choices"][0]["message"]) == [] and plain["choices"][0]["message"]["content"]
    call = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}</tool_call>'
    ours = both_chat(servers, {**body, "structured_outputs": {"regex": "Let me check[.] " + call},
                               "logit_bias": no_whitespace, "parallel_tool_calls": False})
    assert ours["choices"][0]["finish_reason"] == "tool_calls"
    assert tool_calls(ours["choices"][0]["message"])[0][0] == "get_weather"


def test_reasoning_split_from_content(servers, tiny_model):
    body = {"model": tiny_model, "messages": [{"role": "user", "content": "Think, then answer."}], "max_tokens": 20,
            "temperature": 0}
    thinking = both_chat(servers, body)  # no </think> on a random model: it is all reasoning
    assert thinking["choices"][0]["message"]["reasoning"] and thinking["choices"][0]["message"]["content"] is None
    content = both_chat(servers, {**body, **NO_THINKING})
    assert content["choices"][0]["message"]["content"] and not content["choices"][0]["message"].get("reasoning")
    # include_reasoning false: the grammar applies from the first token, the output holds a
    # think block, and only what follows it is the answer
    forced = both_chat(servers, {**body, "include_reasoning": False,
                                 "structured_outputs": {"regex": "<think>[a-z]{2,8}</think>[a-z ]{3,20}"}})
    msg = forced["choices"][0]["message"]
    assert msg.get("reasoning") is None and msg["content"] and "think>" not in msg["content"]
    # a prefill that closes the reasoning: what follows it is content
    prefilled = both_chat(servers, {**body, "messages": [*body["messages"], {"role": "assistant",
                                                                             "content": "<think>easy</think>So"}],
                                    "add_generation_prompt": False, "continue_final_message": True})
    assert prefilled["usage"]["completion_tokens"] == 20


TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% if documents %}{% for d in documents %}Doc {{ d.title }}: {{ d.text }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{{ greeting | default('') }}{% endif %}")


def test_chat_template_fields_render_the_same_prompt(servers, tiny_model):
    history = [{"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Use tools."},
               {"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    base = {"model": tiny_model, "messages": history, "max_tokens": 8, "temperature": 0, "return_token_ids": True,
            **NO_THINKING}
    for fields in ({}, {"tools": TOOLS, "tool_choice": "none", "chat_template": TEMPLATE},
                   {"chat_template": TEMPLATE, "documents": [{"title": "A", "text": "rain"}],
                    "chat_template_kwargs": {"greeting": "Sure,", "enable_thinking": False}},
                   {"messages": [*history[:3], {"role": "assistant", "content": "It is"}], "add_generation_prompt": False,
                    "continue_final_message": True, "echo": True}):
        ours, theirs = both(servers, "/v1/chat/completions", {**base, **fields})
        same_chat(ours, theirs)
        assert ours["prompt_token_ids"]
    assert ours["choices"][0]["message"]["content"].startswith("It is")  # echo of the continued message


CHAT = [{"role": "user", "content": "hi"}]
TOOL_BAD = [
    ("/v1/chat/completions", {"messages": CHAT, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}}),
    ("/v1/chat/completions", {"messages": CHAT, "tools": []}),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}),
    ("/v1/chat/completions", {"messages": CHAT, "tools": TOOLS, "tool_choice": "sometimes"}),
    ("/v1/chat/completions", {"messages": CHAT, "structured_outputs": {"regex": "a", "choice": ["b"]}}),
    ("/v1/chat/completions", {"messages": CHAT, "continue_final_message": True, "add_generation_prompt": True}),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 10, "max_tokens": 4}),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"nope": 1}}),
    ("/v1/completions", {"prompt": "hi", "bad_words": [""]}),
    ("/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": 100000}),
]


@pytest.mark.parametrize("path,body", TOOL_BAD, ids=[json.dumps(b)[:60] for _, b in TOOL_BAD])
def test_bad_tool_and_sampling_fields_get_vllms_status(servers, tiny_model, path, body):
    test_bad_fields_get_the_same_status_and_error_shape(servers, tiny_model, path, body)
