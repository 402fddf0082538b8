"""vLLM's own tool-call and reasoning parsers, as its chat server uses them, for one served
model: :class:`ModelParser` composes the model's parsers with vLLM's ParserManager (as
``vllm serve --tool-call-parser ... --reasoning-parser ...`` does) and runs them on
llmpipe's messages.

* preprocess: :meth:`ModelParser.adjust` is vLLM's ``adjust_request`` (a ``tool_choice``
  of ``required`` or a named function becomes guided decoding, a parser may keep special
  tokens in the text), and vLLM's ``reasoning_ended`` for the engine;
* postprocess: :meth:`ModelParser.parse` splits a finished output into reasoning, content
  and tool calls, with the branches of vLLM's chat_completion_full_generator;
* the inference worker: :meth:`ModelParser.stream` parses a streamed output delta by delta
  (llmpipe/parsing/streams.py), as vLLM's chat_completion_stream_generator.

vLLM is imported when a ModelParser first builds its parser class, once per process, and
only in a process that got a request for a model with parsers: the parser modules import
torch and transformers (docs/api.md gives the measured cost). The parsers run on vLLM's
own request type, built from the fields llmpipe carries (OutputParsing).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Iterator
from functools import cached_property
from typing import Any

from llmpipe.errors import BadRequestError, LlmpipeError
from llmpipe.messages import FunctionCall, OutputParsing, Parsed, SamplingParams, StructuredOutput, ToolCall
from llmpipe.parsing.config import ModelParsers

log = logging.getLogger("llmpipe.parsing")

_PLACEHOLDER = [{"role": "user", "content": ""}]  # vLLM's request needs messages; the parsers do not read them


class ParserSetupError(LlmpipeError):
    """The model's parser settings cannot work with its tokenizer (vLLM's start-up check):
    the server's fault, an internal error naming the settings."""


@contextlib.contextmanager
def adjust_errors() -> Iterator[None]:
    """vLLM's validation errors while adjusting a request (a tool schema its grammar backend
    refuses, ...) as the 400 they are; pydantic's from building vLLM's request too."""
    from pydantic import ValidationError
    from vllm.exceptions import VLLMValidationError

    try:
        yield
    except VLLMValidationError as exc:
        raise BadRequestError(str(exc), param=getattr(exc, "parameter", None)) from None
    except ValidationError as exc:
        raise BadRequestError(f"the request does not fit vLLM's chat request: {exc.errors()[0].get('msg')}",
                              param="tools") from None


def is_named(choice: Any) -> bool:
    return isinstance(choice, dict)


class ModelParser:
    """vLLM's composed Parser class for one model, with the model's tokenizer."""

    def __init__(self, tokenizer: Any, parsers: ModelParsers, model: str):
        self.tokenizer = tokenizer
        self.parsers = parsers
        self.model = model
        self._lock = threading.Lock()

    @cached_property
    def cls(self) -> Any:
        """vLLM's Parser class (ParserManager.get_parser, with its tokenizer check). Imports vLLM."""
        with self._lock:
            from vllm.parser import ParserManager

            p = self.parsers
            try:
                return ParserManager.get_parser(tool_parser_name=p.tool_call_parser, reasoning_parser_name=p.reasoning_parser,
                                                enable_auto_tools=p.enable_auto_tool_choice, model_name=self.model,
                                                tool_strict_level=p.tool_strict_level, tokenizer=self.tokenizer)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise ParserSetupError(f"model {self.model}: tool_call_parser={p.tool_call_parser!r}, "
                                       f"reasoning_parser={p.reasoning_parser!r}, "
                                       f"tool_strict_level={p.tool_strict_level!r}: {exc}") from exc

    @property
    def has_tool_parser(self) -> bool:
        return self.cls is not None and self.cls.tool_parser_cls is not None

    def request(self, spec: OutputParsing, params: SamplingParams | None = None, messages: list[dict] | None = None) -> Any:
        """vLLM's ChatCompletionRequest with what the parsers read of ours."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        body: dict[str, Any] = {"messages": messages or _PLACEHOLDER, "tool_choice": spec.tool_choice,
                                "parallel_tool_calls": spec.parallel_tool_calls, "include_reasoning": spec.include_reasoning,
                                "chat_template_kwargs": spec.template_kwargs or None}
        if spec.tools is not None:
            body["tools"] = spec.tools
        req = ChatCompletionRequest.model_validate(body)
        if params is not None:
            req.skip_special_tokens = params.skip_special_tokens
            req.spaces_between_special_tokens = params.spaces_between_special_tokens
            req.structured_outputs = to_vllm_structured(params.structured)
        return req

    def new(self, spec: OutputParsing, req: Any) -> Any:
        """A parser for one output (vLLM's parsers keep state: one per choice)."""
        return self.cls(self.tokenizer, req.tools, chat_template_kwargs=spec.template_kwargs, model_config=None)

    def adjust(self, spec: OutputParsing, params: SamplingParams, messages: list[dict],
               prompt_ids: list[int]) -> tuple[SamplingParams, bool | None]:
        """vLLM's adjust_request for this request (when its chat server would run it), and
        its reasoning_ended: the sampling parameters to run with and the engine's flag."""
        cls = self.cls
        req = self.request(spec, params, messages)
        parser = self.new(spec, req)
        should = cls.always_adjust_request or cls.reasoning_parser_cls is not None or spec.tool_choice != "none"
        if should:
            req = parser.adjust_request(request=req)
        structured = from_vllm_structured(req.extract_structured_outputs())
        out = params.model_copy(update={"skip_special_tokens": req.skip_special_tokens,
                                        "spaces_between_special_tokens": req.spaces_between_special_tokens,
                                        "structured": structured})
        return out, req.resolve_reasoning_ended(parser, prompt_ids)

    def parse(self, spec: OutputParsing, text: str, token_ids: list[int], stopped: bool) -> Parsed:
        """A finished output as vLLM's chat server answers it (``stopped``: finish_reason "stop")."""
        from vllm.renderers.chat_utils import make_tool_call_id

        req = self.request(spec)
        parser = self.new(spec, req)
        if spec.prompt_token_ids is not None:
            parser.set_prompt_token_ids(spec.prompt_token_ids)
        reasoning, content, calls = parser.parse(text, req, enable_auto_tools=self.parsers.enable_auto_tool_choice,
                                                 model_output_token_ids=token_ids)
        if not spec.include_reasoning:
            reasoning = None
        out = Parsed(reasoning=reasoning, content=content, reasoning_tokens=parser.count_reasoning_tokens(token_ids))
        choice = spec.tool_choice
        named, required = is_named(choice), choice == "required"
        auto_tools = self.parsers.enable_auto_tool_choice and self.has_tool_parser
        if named or required:
            out.content = content or ""
            out.tool_calls = [_call(c, make_tool_call_id) for c in calls or []]
        elif auto_tools and spec.tools and choice in ("auto", None) and calls:
            out.tool_calls = [_call(c, make_tool_call_id) for c in calls]
        out.tools_called = bool(out.tool_calls and not named and not required) or (required and stopped)
        if spec.parallel_tool_calls is False:
            out.tool_calls = out.tool_calls[:1]
        return out

    def stream(self, spec: OutputParsing, prompt_ids: list[int]) -> StreamParse:
        req = self.request(spec)
        return StreamParse(self.new(spec, req), req, prompt_ids, spec)


def _call(c: Any, make_id) -> ToolCall:
    return ToolCall(id=c.id or make_id(), function=FunctionCall(name=c.name, arguments=c.arguments))


class StreamParse:
    """vLLM's parse_delta for one streamed output: text deltas (with their token ids) in,
    vLLM's delta messages out, as JSON-ready dicts (``exclude_unset``, as vLLM's chunks)."""

    def __init__(self, parser: Any, req: Any, prompt_ids: list[int], spec: OutputParsing):
        self.parser = parser
        self.req = req
        self.prompt_ids = prompt_ids
        self.spec = spec

    def push(self, text: str, ids: list[int], finished: bool) -> dict | None:
        msg = self.parser.parse_delta(text, list(ids), self.req, prompt_token_ids=self.prompt_ids, finished=finished)
        if msg is None:
            return None
        if self.spec.parallel_tool_calls is False and msg.tool_calls:
            msg.tool_calls = [c for c in msg.tool_calls if c.index == 0]  # vLLM's maybe_filter_parallel_tool_calls
        return msg.model_dump(exclude_unset=True)


def to_vllm_structured(s: StructuredOutput | None) -> Any:
    if s is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(
        json=s.json_schema, regex=s.regex, choice=s.choice, grammar=s.grammar,
        json_object=True if s.json_object else None, structural_tag=s.structural_tag,
        disable_any_whitespace=s.disable_any_whitespace, disable_additional_properties=s.disable_additional_properties,
        whitespace_pattern=s.whitespace_pattern)


def from_vllm_structured(p: Any) -> StructuredOutput | None:
    if p is None:
        return None
    schema = p.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise BadRequestError(f"the JSON schema is not valid JSON: {exc}", param="structured_outputs") from None
    return StructuredOutput(json_object=bool(p.json_object), json_schema=schema, regex=p.regex, choice=p.choice,
                            grammar=p.grammar, structural_tag=p.structural_tag,
                            disable_any_whitespace=p.disable_any_whitespace,
                            disable_additional_properties=p.disable_additional_properties,
                            whitespace_pattern=p.whitespace_pattern)
