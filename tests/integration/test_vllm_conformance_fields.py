"""llmpipe as a drop-in for ``vllm serve``, field by field: every sampling field, the
detokenizing options, prompt truncation, guided decoding (and vLLM's older guided_* names),
forced and auto tool calls, the split of reasoning from content and the chat template's
fields, each plain and streamed (the accumulated stream), and the status vLLM gives a bad
one. The two servers (tests/harness/vllm_pair.py) are the ones test_vllm_conformance.py
uses. The qwen3 reasoning parser makes a chat output reasoning until ``</think>`` (all of
it, on a random model) unless ``chat_template_kwargs`` turn thinking off; the tests that
want content say so."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.harness.vllm_pair import (
    both,
    both_chat,
    post,
    same_chat,
    same_completion,
    same_error,
    stream_text,
    token_ids,
    tool_calls,
)

pytestmark = pytest.mark.integration


def test_sampling_fields(servers, tiny_model):
    prompt = "The weather in Paris is"
    ref = token_ids(servers, tiny_model, prompt, 16)
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
        (t1, _), (t2, _) = (stream_text(base, {**stream, "stream": True}) for base in servers)
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
        (t1, _), (t2, _) = (stream_text(b, {**stream, "stream": True}) for b in servers)
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
        alias = post(servers[0], path, {**body, older: next(iter(constraint.values()))})
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
    same_error(servers, tiny_model, path, body)
