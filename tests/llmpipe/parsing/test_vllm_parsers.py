"""The parser adapters on fixed model outputs, on the tiny model's tokenizer with vLLM's own
hermes tool parser and qwen3 reasoning parser (the ones the conformance test serves): a
finished output split as vLLM's chat server splits it, a stream parsed delta by delta
(tags split across tokens, an output cut in the middle of a tool call), and the stream
ending equal to the finished output. vLLM is imported here (seconds), as in a worker."""

from __future__ import annotations

import json
import os

import pytest

from llmpipe.messages import Detokenizing, OutputParsing, SamplingParams, StructuredOutput
from llmpipe.parsing.config import ModelParsers
from llmpipe.parsing.streams import make_stream
from llmpipe.parsing.vllm_parsers import ModelParser, from_vllm_structured, to_vllm_structured

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": None, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture(scope="module")
def hermes(tiny_tokenizer):
    return ModelParser(tiny_tokenizer, ModelParsers("hermes", None, True), "tiny")


@pytest.fixture(scope="module")
def both(tiny_tokenizer):
    return ModelParser(tiny_tokenizer, ModelParsers("hermes", "qwen3", True), "tiny")


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _spec(choice="auto", **kw):
    return OutputParsing(tools=TOOLS, tool_choice=choice, **kw)


def _stream(parser, tok, spec, text, chunks=None, stop=()):
    """The deltas of ``text`` streamed one token at a time, accumulated as a client does."""
    ids = _ids(tok, text)
    s = make_stream(parser.stream(spec, [1, 2]), tok, [], list(stop), Detokenizing())
    deltas = []
    for k in range(1, len(ids) + 1):
        _, got = s.advance(ids[:k], final=k == len(ids))
        deltas += got
    out = {"content": "", "reasoning": "", "calls": {}}
    for d in deltas:
        out["content"] += d.get("content") or ""
        out["reasoning"] += d.get("reasoning") or ""
        for c in d.get("tool_calls") or []:
            call = out["calls"].setdefault(c["index"], {"name": "", "arguments": ""})
            call["name"] += (c.get("function") or {}).get("name") or ""
            call["arguments"] += (c.get("function") or {}).get("arguments") or ""
    return out, deltas


def test_an_auto_tool_call_is_parsed_with_the_content_before_it(hermes, tiny_tokenizer):
    text = "Let me look. " + CALL
    p = hermes.parse(_spec(), text, _ids(tiny_tokenizer, text), stopped=True)
    assert p.content == "Let me look. " and p.tools_called
    assert [(c.function.name, json.loads(c.function.arguments)) for c in p.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert p.tool_calls[0].id.startswith("chatcmpl-tool-")


def test_an_output_cut_in_the_middle_of_a_tool_call_stays_content(hermes, tiny_tokenizer):
    """max_tokens ended it inside the call: hermes finds no complete call, the text is content
    (vLLM's answer), and finish_reason is not tool_calls."""
    text = "Ok " + CALL[:40]
    p = hermes.parse(_spec(), text, _ids(tiny_tokenizer, text), stopped=False)
    assert p.tool_calls == [] and not p.tools_called and p.content == text
    streamed, _ = _stream(hermes, tiny_tokenizer, _spec(), text)
    assert streamed["content"] == "Ok "  # what follows the partial tag is held as a call in progress
    assert streamed["calls"][0]["name"] == "get_weather"


def test_streamed_deltas_that_split_the_tag_never_leak_it_as_content(hermes, tiny_tokenizer):
    text = "Sure " + CALL
    ids = _ids(tiny_tokenizer, text)
    pieces = [tiny_tokenizer.decode([i]) for i in ids]
    assert "<tool_call>" not in pieces  # the tag really is split across tokens in this tokenizer
    streamed, deltas = _stream(hermes, tiny_tokenizer, _spec(), text)
    assert streamed["content"] == "Sure " and all("<" not in (d.get("content") or "") for d in deltas)
    final = hermes.parse(_spec(), text, ids, stopped=True)
    assert streamed["calls"][0]["name"] == final.tool_calls[0].function.name
    assert json.loads(streamed["calls"][0]["arguments"]) == json.loads(final.tool_calls[0].function.arguments)


def test_tool_choice_none_leaves_a_call_in_the_content(hermes, tiny_tokenizer):
    p = hermes.parse(_spec("none"), CALL, _ids(tiny_tokenizer, CALL), stopped=True)
    assert p.content == CALL and p.tool_calls == [] and not p.tools_called


def test_parallel_tool_calls_false_keeps_the_first(hermes, tiny_tokenizer):
    text = CALL + CALL.replace("Paris", "Rome")
    p = hermes.parse(_spec(parallel_tool_calls=False), text, _ids(tiny_tokenizer, text), stopped=True)
    assert len(p.tool_calls) == 1 and "Paris" in p.tool_calls[0].function.arguments
    streamed, _ = _stream(hermes, tiny_tokenizer, _spec(parallel_tool_calls=False), text)
    assert list(streamed["calls"]) == [0]


def test_reasoning_is_split_from_content_plain_and_streamed(both, tiny_tokenizer):
    text = "step one, step two</think>The answer is 4."
    spec = OutputParsing(template_kwargs={})
    p = both.parse(spec, text, _ids(tiny_tokenizer, text), stopped=True)
    assert (p.reasoning, p.content) == ("step one, step two", "The answer is 4.")
    streamed, _ = _stream(both, tiny_tokenizer, spec, text)
    assert (streamed["reasoning"], streamed["content"]) == (p.reasoning, p.content)
    off = OutputParsing(template_kwargs={"enable_thinking": False})
    assert both.parse(off, "plain words", _ids(tiny_tokenizer, "plain words"), stopped=True).reasoning is None
    hidden = both.parse(spec.model_copy(update={"include_reasoning": False}), text, _ids(tiny_tokenizer, text), stopped=True)
    assert hidden.reasoning is None and hidden.content == "The answer is 4."


def test_a_stop_string_ends_the_parsed_stream(hermes, tiny_tokenizer):
    streamed, _ = _stream(hermes, tiny_tokenizer, _spec(), "alpha beta STOP gamma", stop=["STOP"])
    assert streamed["content"] == "alpha beta "


def test_a_resumed_stream_repeats_nothing(hermes, tiny_tokenizer):
    """A request run again continues after the ids it streamed: they are fed without output."""
    text = "Sure " + CALL
    ids = _ids(tiny_tokenizer, text)
    whole, _ = _stream(hermes, tiny_tokenizer, _spec(), text)
    cut = len(ids) // 2
    first = make_stream(hermes.stream(_spec(), [1, 2]), tiny_tokenizer, [], [], Detokenizing())
    n, before = first.advance(ids[:cut])
    again = make_stream(hermes.stream(_spec(), [1, 2]), tiny_tokenizer, [], [], Detokenizing(), prefix=ids[:n])
    _, after = again.advance(ids, final=True)
    args = "".join((c.get("function") or {}).get("arguments") or "" for d in before + after for c in d.get("tool_calls") or [])
    assert json.loads(args) == json.loads(whole["calls"][0]["arguments"])


def test_required_and_named_tool_choice_become_guided_decoding(hermes, tiny_tokenizer):
    """vLLM's adjust_request: a forced call is a structural tag for the engine (hermes keeps
    special tokens in the text); auto and none constrain nothing."""
    params = SamplingParams(max_tokens=8)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        out, reasoning_ended = hermes.adjust(_spec(choice), params, [{"role": "user", "content": "hi"}], [5, 6])
        assert out.structured is not None and out.structured.structural_tag and "get_weather" in out.structured.structural_tag
        assert out.skip_special_tokens is False and reasoning_ended is None
    out, _ = hermes.adjust(_spec("none"), params, [{"role": "user", "content": "hi"}], [5, 6])
    assert out.structured is None and out.skip_special_tokens is True


def _tag_contents(structural_tag: str) -> list:
    return [t["content"]["json_schema"] for t in json.loads(structural_tag)["format"]["tags"]]


def test_tool_strict_level_decides_whether_a_forced_calls_arguments_follow_the_schema(tiny_tokenizer):
    """vLLM's --tool-strict-level: on auto a tool not marked strict gets any JSON as its
    arguments (a small model may answer a string, which clients that read the arguments as
    an object refuse); parameter pins every tool's arguments to its parameters schema."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    hi, params = [{"role": "user", "content": "hi"}], SamplingParams(max_tokens=8)
    auto = ModelParser(tiny_tokenizer, ModelParsers("hermes", None, True), "tiny")
    out, _ = auto.adjust(_spec(named), params, hi, [5, 6])
    assert set(map(json.dumps, _tag_contents(out.structured.structural_tag))) == {"true"}
    strict = ModelParser(tiny_tokenizer, ModelParsers("hermes", None, True, "parameter"), "tiny")
    for choice in ("required", named):
        out, _ = strict.adjust(_spec(choice), params, hi, [5, 6])
        assert all(c == TOOLS[0]["function"]["parameters"] for c in _tag_contents(out.structured.structural_tag))
    with pytest.raises(ValueError, match="tool_strict_level 'all' is not one of vLLM's levels"):
        ModelParsers("hermes", None, True, "all").check("")


def test_structured_outputs_round_trip_through_vllms_type():
    s = StructuredOutput(regex="a+", whitespace_pattern=r"\s")
    assert from_vllm_structured(to_vllm_structured(s)) == s
    j = StructuredOutput(json_schema={"type": "object"}, disable_any_whitespace=True)
    assert from_vllm_structured(to_vllm_structured(j)) == j


def test_up_takes_vllm_serves_parser_flags(monkeypatch, tmp_path):
    """`llmpipe up` takes the parser flags as `vllm serve` spells them; an unknown parser stops
    the start naming the setting; unset flags leave the environment's settings alone."""
    from click.testing import CliRunner

    from llmpipe.cli import main

    for k in [k for k in os.environ if k.startswith("LLMPIPE_")]:
        monkeypatch.delenv(k)
    base = ["up", "--print-config", "--state-dir", str(tmp_path)]
    ok = CliRunner().invoke(main, [*base, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                   "--reasoning-parser", "qwen3", "--trust-request-chat-template",
                                   "--tool-strict-level", "parameter"])
    assert ok.exit_code == 0, ok.output
    for line in ("enable_auto_tool_choice = true", 'tool_call_parser = "hermes"', 'reasoning_parser = "qwen3"',
                 "trust_request_chat_template = true", 'tool_strict_level = "parameter"'):
        assert line in ok.output
    monkeypatch.setenv("LLMPIPE_TRUST_REQUEST_CHAT_TEMPLATE", "true")
    kept = CliRunner().invoke(main, base)
    assert kept.exit_code == 0 and "trust_request_chat_template = true" in kept.output, kept.output
    bad = CliRunner().invoke(main, [*base, "--tool-call-parser", "nope"])
    assert bad.exit_code == 1 and "tool_call_parser 'nope' is not one of vLLM's parsers" in bad.output
