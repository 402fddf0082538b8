"""Request and response bodies of the OpenAI-compatible endpoints."""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator
from pydantic.json_schema import SkipJsonSchema

from api.openai import sampling, structured
from api.openai.chat import (
    CHAT_RULES,
    ChatFields,
    ChatIn,
    check_generation_prompt,
    check_tool_usage,
    legacy_functions,
    reasoning_alias,
)
from api.openai.sampling import SamplingFields
from api.openai.structured import ResponseFormat, StructuredOutputsIn
from api.validation import (
    Bool,
    Float,
    InVocab,
    Int,
    Limit,
    LogprobsRange,
    OneError,
    Priority,
    Seed,
    TokenId,
    allowed_values,
    same_json,
)
from llmpipe.errors import BadRequestError
from llmpipe.messages import SamplingParams, StructuredOutput


class StreamOptions(BaseModel):
    include_usage: Bool = False
    continuous_usage_stats: Bool = False  # vLLM: usage on every chunk (with include_usage)


# Fields of vLLM's (and OpenAI's) requests that llmpipe does not implement, with the values
# that ask for nothing: any other value is refused with a 400 naming the field, never ignored
# (docs/api.md says why each is refused).
_UNSUPPORTED: dict[str, tuple] = {
    "best_of": (None, 1), "use_beam_search": (None, False), "length_penalty": (None, 1),
    "suffix": (None, ""), "prompt_embeds": (None,), "logprob_token_ids": (None, []),
    "mm_processor_kwargs": (None,), "media_io_kwargs": (None,), "kv_transfer_params": (None,),
    "vllm_xargs": (None,), "thinking_token_budget": (None, -1), "repetition_detection": (None,),
    "guided_decoding_backend": (None,), "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
}


# Rules between fields, as JSON Schema: streaming takes no logprobs and no token ids, and
# stream_options only with streaming (vLLM's rules; api/openai/features.py and the
# validators below enforce them).
_STREAM_RULES = {
    "if": {"properties": {"stream": {"const": True}}, "required": ["stream"]},
    "then": {"properties": {"prompt_logprobs": {"type": "null"}, "return_token_ids": {"enum": [None, False]}}},
    "else": {"properties": {"stream_options": {"type": "null"}}},
}


def _schema_extra(unsupported: dict[str, tuple], rules: list[dict]):
    def extra(schema: dict[str, Any]) -> None:
        schema.setdefault("properties", {}).update(allowed_values(unsupported))
        schema["allOf"] = rules
    return extra


class _Common(SamplingFields):
    # Unknown fields are ignored, as vLLM and OpenAI's own server do; known ones that
    # llmpipe does not implement are refused (_UNSUPPORTED) unless they ask for nothing.
    model_config = ConfigDict(extra="allow", json_schema_extra=_schema_extra(_UNSUPPORTED, [_STREAM_RULES]))
    _unsupported: ClassVar[dict[str, tuple]] = _UNSUPPORTED

    model: str | None = None
    temperature: Float(ge=0.0, le=2.0) = 1.0
    top_p: Float(gt=0.0, le=1.0) = 1.0
    n: Int(Limit("max_n", param="n"), ge=1) = Field(default=1, description="Choices per prompt; at most max_n.")
    seed: Seed | None = None
    stop: Annotated[str | Annotated[list[str], Field(max_length=16)] | None,
                    OneError("stop must be a string or a list of at most 16 strings")] = None
    stream: Bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: Bool = False
    stop_token_ids: list[Annotated[TokenId, InVocab()]] = Field(default_factory=list, max_length=64)
    user: str | None = None
    timeout: Float(gt=0) | None = Field(default=None, description="llmpipe: seconds until the request expires.")
    response_format: ResponseFormat | None = Field(
        default=None, description="json_object, json_schema or structural_tag (the vllm engine's structured outputs).")
    structured_outputs: StructuredOutputsIn | None = Field(
        default=None, description="vLLM's guided decoding: one of json, regex, choice, grammar, json_object, structural_tag.")
    # vLLM's older names of structured_outputs' fields (vLLM 0.32 dropped them): taken, and
    # left out of the OpenAPI document, as vLLM's own leaves them out.
    guided_json: SkipJsonSchema[dict | str | None] = None
    guided_regex: SkipJsonSchema[str | None] = None
    guided_choice: SkipJsonSchema[list[str] | None] = None
    guided_grammar: SkipJsonSchema[str | None] = None
    guided_whitespace_pattern: SkipJsonSchema[str | None] = None
    prompt_logprobs: Int(LogprobsRange("prompt_logprobs", "prompt")) | None = Field(
        default=None, description="vLLM: log probabilities of each prompt token; at most max_logprobs.")
    return_tokens_as_token_ids: Bool | None = Field(
        default=None, description="vLLM: logprob tokens as 'token_id:<id>' instead of their text.")
    return_token_ids: Bool | None = Field(default=None, description="vLLM: token_ids and prompt_token_ids in the answer.")
    priority: Priority = 0

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        for name, value in (self.model_extra or {}).items():
            ok = self._unsupported.get(name)
            if ok is not None and not any(same_json(value, v) for v in ok):
                raise BadRequestError(f"`{name}` is not supported by llmpipe", param=name)
        if self.stream_options is not None and not self.stream:
            raise BadRequestError("Stream options can only be defined when `stream=True`.", param="stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise BadRequestError("`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")
        return self

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def structured(self) -> StructuredOutput | None:
        guided = {k: getattr(self, k) for k in structured.GUIDED}
        return structured.resolve(self.structured_outputs, self.response_format, guided, self.named_tool_choice())

    def named_tool_choice(self) -> dict | None:
        return None

    def sampling(self, max_tokens: int, k: int = 0) -> SamplingParams:
        """The sampling parameters of choice ``k``, once vLLM's checks of the fields passed
        (api/openai/sampling.py, with the effective max_tokens)."""
        sampling.check(self, max_tokens=max_tokens)
        return sampling.in_vocab(SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            seed=None if self.seed is None else self.seed + k, stop_token_ids=self.stop_token_ids,
            stop=self.stops(), ignore_eos=self.ignore_eos, logprobs=self.sample_logprobs(),
            prompt_logprobs=self.prompt_logprobs, echo=self.echoes() or bool(self.return_token_ids),
            structured=self.structured(),
            **self.vllm_params(),
        ))

    def sample_logprobs(self) -> int | None:
        """How many top logprobs per generated token (None: none asked)."""
        return None

    def echoes(self) -> bool:
        return False


_Text = Annotated[str, Field(min_length=1), Limit("max_prompt_chars", "length", param="prompt")]
_Ids = Annotated[list[Int(Limit("max_token_id", param="prompt"), ge=0)], Field(min_length=1)]
_Prompts = Limit("max_prompts_per_job", "items", param="prompt")


def _completion_rules() -> list[dict]:
    return [
        {**_STREAM_RULES, "then": {"properties": {**_STREAM_RULES["then"]["properties"], "logprobs": {"type": "null"}}}},
        # max_tokens 0: score the prompt only, with echo and without streaming (vLLM)
        {"if": {"properties": {"max_tokens": {"const": 0}}, "required": ["max_tokens"]},
         "then": {"properties": {"echo": {"const": True}, "stream": {"const": False}}, "required": ["echo"]}},
    ]


class CompletionRequest(_Common):
    model_config = ConfigDict(json_schema_extra=_schema_extra(_UNSUPPORTED, _completion_rules()))

    prompt: Annotated[
        _Text | Annotated[list[_Text], Field(min_length=1), _Prompts] | _Ids
        | Annotated[list[_Ids], Field(min_length=1), _Prompts],
        OneError("prompt must be a non-empty text, a list of them, a non-empty list of token ids, or a list of those"),
    ] = Field(description="Text prompt(s), or token-id prompt(s): one list of ids, or a list of them; "
                          "at most max_prompts_per_job prompts of at most max_prompt_chars characters.")
    max_tokens: Int(Limit("max_tokens_limit", param="max_tokens"), ge=0) | None = Field(
        default=16, description="At most max_tokens_limit; 0 with echo: score the prompt only, as vLLM.")
    echo: Bool = False
    logprobs: Int(LogprobsRange("logprobs", "sample")) | None = Field(
        default=None, description="Top logprobs per token (0: the sampled token's only); at most max_logprobs.")

    @model_validator(mode="after")
    def _echo_only(self):
        if self.max_tokens == 0 and not self.echo:
            raise BadRequestError("max_tokens must be at least 1, got 0.", param="max_tokens")
        if self.max_tokens == 0 and self.stream:
            raise BadRequestError("llmpipe does not stream an echo without generation (max_tokens 0)", param="max_tokens")
        return self

    def echo_only(self) -> bool:
        """vLLM: echo with max_tokens 0 answers the prompt alone (one token is generated, unseen)."""
        return self.echo and self.max_tokens == 0

    def inputs(self) -> list[dict]:
        """One job input per prompt: {"prompt": text} or {"prompt_token_ids": ids}."""
        p = self.prompt
        if isinstance(p, str):
            return [{"prompt": p}]
        if all(isinstance(x, int) for x in p):
            return [{"prompt_token_ids": list(p)}]
        return [{"prompt": x} if isinstance(x, str) else {"prompt_token_ids": list(x)} for x in p]

    def prompts(self) -> list[str]:
        return [i.get("prompt", "") for i in self.inputs()]

    def sample_logprobs(self) -> int | None:
        return self.logprobs

    def echoes(self) -> bool:
        return self.echo

    def sampling(self, max_tokens: int, k: int = 0) -> SamplingParams:
        p = super().sampling(max_tokens, k)
        if self.echo and self.logprobs is not None and self.prompt_logprobs is None:
            p.prompt_logprobs = self.logprobs  # vLLM: echo with logprobs scores the prompt too
        return p


# Chat: the same fields are refused (vLLM's chat has them all).
_CHAT_UNSUPPORTED = dict(_UNSUPPORTED)
_CHAT_RULES = [
    {**_STREAM_RULES, "then": {"properties": {**_STREAM_RULES["then"]["properties"], "logprobs": {"const": False}}}},
    # top_logprobs asks for something only with logprobs: true (vLLM)
    {"anyOf": [{"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
               {"properties": {"top_logprobs": {"enum": [0, None]}}}]},
    *CHAT_RULES,
]


class ChatCompletionRequest(ChatFields, _Common):
    model_config = ConfigDict(json_schema_extra=_schema_extra(_CHAT_UNSUPPORTED, _CHAT_RULES))
    _unsupported: ClassVar[dict[str, tuple]] = _CHAT_UNSUPPORTED

    messages: list[ChatIn] = Field(min_length=1)
    echo: Bool = Field(default=False, description="vLLM: the answer starts with the last message's content when "
                                                  "it has the answer's role (with continue_final_message).")
    legacy_functions: SkipJsonSchema[bool] = Field(default=False, exclude=True)
    max_tokens: Int(Limit("max_tokens_limit", param="max_tokens"), ge=1) | None = Field(
        default=None, description="At most max_tokens_limit; default: the server's default_max_tokens.")
    max_completion_tokens: Int(Limit("max_tokens_limit", param="max_completion_tokens"), ge=1) | None = None
    logprobs: Bool = False
    top_logprobs: Int(LogprobsRange("top_logprobs", "sample", over_param="logprobs")) | None = Field(
        default=0, description="With logprobs: this many top tokens per position; at most max_logprobs.")

    @model_validator(mode="before")
    @classmethod
    def _vllm_before(cls, data: Any) -> Any:
        # vLLM's before-validators, in its order, on the raw body.
        return check_generation_prompt(check_tool_usage(reasoning_alias(legacy_functions(data))))

    @model_validator(mode="after")
    def _top_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise BadRequestError("when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs")
        return self

    def named_tool_choice(self) -> dict | None:
        c = self.tool_choice_value()
        return c if isinstance(c, dict) else None

    def response_role(self) -> str:
        """vLLM's: the assistant's, or the last message's without a generation prompt."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    def echo_text(self) -> str:
        """With echo: the last message's content when it has the answer's role (vLLM)."""
        last = self.messages[-1]
        if not self.echo or last.role != self.response_role():
            return ""
        return last.to_message().content or ""

    def sample_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def sampling(self, max_tokens: int, k: int = 0, *, score_echo: bool = True) -> SamplingParams:
        """``score_echo``: vLLM scores an echoed prompt (prompt_logprobs, top_logprobs each)
        unless asked otherwise; off for an engine that returns no log probabilities."""
        p = super().sampling(max_tokens, k)
        if score_echo and self.echo and self.prompt_logprobs is None and not self.stream:
            p.prompt_logprobs = self.top_logprobs
        return p


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class UsageOut(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails | None = Field(
        default=None, description="vLLM: with a reasoning parser, the output's reasoning tokens.")


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: list[dict | None] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageOut


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning: str | None = Field(default=None, description="vLLM: the reasoning parser's share of the output.")
    tool_calls: list[ToolCallOut] = Field(default_factory=list, description="Parsed tool calls (left out when none).")
    function_call: FunctionCallOut | None = Field(default=None, description="With OpenAI's older functions.")

    @model_serializer(mode="wrap")
    def _serialize(self, handler):
        data = handler(self)
        if not data.get("tool_calls"):
            data.pop("tool_calls", None)  # vLLM leaves an empty list out
        if data.get("function_call") is None:
            data.pop("function_call", None)
        return data


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageOut
    prompt_logprobs: list[dict | None] | None = None
    prompt_token_ids: list[int] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "llmpipe"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
