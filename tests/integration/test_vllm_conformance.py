"""llmpipe as a drop-in for ``vllm serve``: the same requests to both, on the tiny model at
temperature 0 (or with a seed), answer the same. Token ids, text, logprobs (to 1e-4), finish
and stop reasons, usage, the error shapes of bad fields, the endpoints vLLM's clients probe,
and no prompt or output in any log file. The two servers: tests/harness/vllm_pair.py;
sampling fields, guided decoding, tools and reasoning: test_vllm_conformance_fields.py."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.harness.vllm_pair import both, close, post, same_chat, same_completion, same_error, stream_text
from tests.harness.waiting import wait_until

pytestmark = pytest.mark.integration


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
    (t1, _), (t2, _) = (stream_text(base, body) for base in servers)
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


def test_stream_with_continuous_usage(servers, tiny_model):
    body = {"model": tiny_model, "prompt": "Hello", "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    (t1, c1), (t2, c2) = (stream_text(base, body) for base in servers)
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
    same_error(servers, tiny_model, path, body)


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
        r = post(ours, path, {"model": tiny_model, **body}).json()
        job_ids.append(r["id"].split("-", 1)[1])
        outputs += [c.get("text") or c["message"]["content"] or c["message"]["reasoning"] for c in r["choices"]]
    text, _ = stream_text(ours, {"model": tiny_model, "prompt": SECRET, "max_tokens": 12, "temperature": 0, "stream": True})
    outputs.append(text)
    job = httpx.post(f"{ours}/v1/jobs", json={"prompt": SECRET, "max_tokens": 12, "temperature": 0}, timeout=30).json()
    outputs.append(httpx.get(f"{ours}/v1/jobs/{job['id']}", params={"wait": 60}, timeout=90).json()["result"]["results"][0]["text"])
    job_ids.append(job["id"])
    assert post(ours, "/tokenize", {"prompt": SECRET}).status_code == 200

    post_log = servers.log_dir / "postprocess.log"
    wait_until(lambda: all(f"job={j} " in post_log.read_text() for j in job_ids), 60,
               "the postprocess stage's line of every job", every=0.2)
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
