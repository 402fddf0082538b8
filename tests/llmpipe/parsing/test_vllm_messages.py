"""The API checks vLLM's fields without importing vLLM (api/openai/sampling.py, structured.py,
chat.py restate its rules and messages). Here, where vLLM can be imported, a table of bad
values goes through vLLM's own SamplingParams, StructuredOutputsParams and
ChatCompletionRequest and through llmpipe's request models: the same values are refused
with the same message, so the two cannot drift apart."""

from __future__ import annotations

import pytest

from api.openai.protocol import ChatCompletionRequest, CompletionRequest
from llmpipe.errors import BadRequestError

# (field values, the max_tokens they run with)
SAMPLING = [
    ({"presence_penalty": 2.5}, 16), ({"presence_penalty": -3.0}, 16), ({"frequency_penalty": 2.01}, 16),
    ({"repetition_penalty": 0.0}, 16), ({"repetition_penalty": -1.0}, 16), ({"repetition_penalty": float("inf")}, 16),
    ({"top_k": -2}, 16), ({"min_p": 1.5}, 16), ({"min_p": -0.1}, 16), ({"min_tokens": -1}, 16),
    ({"min_tokens": 20}, 8), ({"bad_words": ["a", ""]}, 16), ({"bad_words": [""]}, 16),
    ({"logit_bias": {"x": 1.0}}, 16), ({"logit_bias": {"3": 1.0, "nope": 2.0}}, 16),
]


def _vllm_sampling_message(fields: dict, max_tokens: int) -> str:
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    try:
        SamplingParams.from_optional(max_tokens=max_tokens, **fields)
    except VLLMValidationError as exc:
        return exc.args[0]  # str() adds "(parameter=...)"; the field is our error's param
    raise AssertionError(f"vLLM accepts {fields}")


def _ours(req, max_tokens: int) -> BadRequestError:
    with pytest.raises(BadRequestError) as info:
        req.sampling(max_tokens)
    return info.value


@pytest.mark.parametrize("fields,max_tokens", SAMPLING, ids=[str(f) for f, _ in SAMPLING])
def test_sampling_values_vllm_refuses_are_refused_with_its_message(fields, max_tokens):
    theirs = _vllm_sampling_message(fields, max_tokens)
    for req in (CompletionRequest(prompt="x", **fields),
                ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **fields)):
        err = _ours(req, max_tokens)
        assert err.message == theirs
        assert err.param == next(iter(fields))


STRUCTURED = [
    {"structured_outputs": {"json": {"type": "object"}, "regex": "a"}},
    {"structured_outputs": {"regex": "a", "choice": ["b"]}},
    {"structured_outputs": {"regex": "a", "grammar": "root ::= \"a\""}},
    {"structured_outputs": {"grammar": "root ::= \"a\"", "json_object": True}},
    {"structured_outputs": {"disable_any_whitespace": True}},
    {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
]


def _vllm_chat_message(body: dict) -> str:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VChat
    from vllm.exceptions import VLLMValidationError

    try:
        req = VChat.model_validate({"messages": [{"role": "user", "content": "x"}], **body})
        req.to_sampling_params(16, {})
    except VLLMValidationError as exc:
        return exc.args[0]
    raise AssertionError(f"vLLM accepts {body}")


@pytest.mark.parametrize("body", STRUCTURED, ids=[str(b)[:60] for b in STRUCTURED])
def test_conflicting_constraints_are_refused_with_vllms_message(body):
    theirs = _vllm_chat_message(body)
    with pytest.raises(BadRequestError) as info:
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **body).sampling(16)
    assert info.value.message == theirs


_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
TOOLS = [
    {"tools": []},
    {"tool_choice": "auto"},
    {"tools": [_TOOL], "tool_choice": "sometimes"},
    {"tools": [_TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
    {"tools": [_TOOL], "tool_choice": {"type": "function", "function": "f"}},
    {"tools": [_TOOL], "tool_choice": {"type": "function", "function": {}}},
    {"tools": [_TOOL], "tool_choice": {"type": "function", "function": {"name": ""}}},
    {"continue_final_message": True, "add_generation_prompt": True},
    {"tools": [_TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}},
     "structured_outputs": {"regex": "a"}},
]


@pytest.mark.parametrize("body", TOOLS, ids=[str(b)[:60] for b in TOOLS])
def test_tool_and_template_fields_vllm_refuses_are_refused_with_its_message(body):
    theirs = _vllm_chat_message(body)
    with pytest.raises(BadRequestError) as info:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **body}).sampling(16)
    assert info.value.message == theirs
