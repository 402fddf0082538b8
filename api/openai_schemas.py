"""Request and response bodies of the OpenAI-compatible endpoints."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llmpipe.errors import BadRequestError
from llmpipe.messages import ChatMessage, SamplingParams, StructuredOutput


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk (with include_usage)


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    def structured(self) -> StructuredOutput | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutput(json_object=True)
        if self.json_schema is None:
            raise BadRequestError("When response_format type is 'json_schema', the 'json_schema' field must be provided.",
                                  param="response_format")
        return StructuredOutput(json_schema=self.json_schema.json_schema or {})


# Fields of vLLM's (and OpenAI's) requests that llmpipe does not implement, with the values
# that ask for nothing: any other value is refused with a 400 naming the field, never ignored.
_UNSUPPORTED: dict[str, tuple] = {
    "frequency_penalty": (None, 0), "presence_penalty": (None, 0), "repetition_penalty": (None, 1),
    "logit_bias": (None, {}), "top_k": (None, 0, -1), "min_p": (None, 0), "min_tokens": (None, 0),
    "best_of": (None, 1), "use_beam_search": (None, False), "length_penalty": (None, 1),
    "suffix": (None, ""), "include_stop_str_in_output": (None, False), "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True), "allowed_token_ids": (None, []), "bad_words": (None, []),
    "truncate_prompt_tokens": (None,), "truncation_side": (None,), "prompt_embeds": (None,),
    "structured_outputs": (None,), "logprob_token_ids": (None, []), "tools": (None, []),
    "tool_choice": (None, "none", "auto"), "functions": (None, []), "function_call": (None, "none", "auto"),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "continue_final_message": (None, False), "chat_template": (None,), "chat_template_kwargs": (None, {}),
    "documents": (None,), "mm_processor_kwargs": (None,), "priority": (None, 0), "kv_transfer_params": (None,),
    "vllm_xargs": (None,), "thinking_token_budget": (None, -1), "repetition_detection": (None,),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
}


class _Common(BaseModel):
    # Unknown fields are ignored, as vLLM and OpenAI's own server do; known ones that
    # llmpipe does not implement are refused (_UNSUPPORTED).
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list, max_length=64)
    user: str | None = None
    timeout: float | None = Field(default=None, gt=0, description="llmpipe: seconds until the request expires.")
    response_format: ResponseFormat | None = Field(
        default=None, description="json_object or json_schema: the output is JSON (the vllm engine's structured outputs).")
    prompt_logprobs: int | None = Field(default=None, description="vLLM: log probabilities of each prompt token.")
    return_tokens_as_token_ids: bool | None = Field(
        default=None, description="vLLM: logprob tokens as 'token_id:<id>' instead of their text.")
    return_token_ids: bool | None = Field(default=None, description="vLLM: token_ids and prompt_token_ids in the answer.")

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        for name, value in (self.model_extra or {}).items():
            if name in _UNSUPPORTED and value not in _UNSUPPORTED[name]:
                raise BadRequestError(f"`{name}` is not supported by llmpipe", param=name)
        if self.stream_options is not None and not self.stream:
            raise BadRequestError("Stream options can only be defined when `stream=True`.", param="stream_options")
        if self.prompt_logprobs is not None:
            if self.prompt_logprobs < -1:
                raise BadRequestError("`prompt_logprobs` must be a positive value or -1.", param="prompt_logprobs")
            if self.stream:
                raise BadRequestError("`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")
        return self

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop sequences")
        return v

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling(self, max_tokens: int, k: int = 0) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            seed=None if self.seed is None else self.seed + k, stop_token_ids=self.stop_token_ids,
            stop=self.stops(), ignore_eos=self.ignore_eos, logprobs=self.sample_logprobs(),
            prompt_logprobs=self.prompt_logprobs, echo=self.echoes() or bool(self.return_token_ids),
            structured=self.response_format.structured() if self.response_format else None,
        )

    def sample_logprobs(self) -> int | None:
        """How many top logprobs per generated token (None: none asked)."""
        return None

    def echoes(self) -> bool:
        return False


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="Text prompt(s), or token-id prompt(s): one list of ids, or a list of them.")
    max_tokens: int | None = Field(default=16, ge=0, description="0 with echo: score the prompt only, as vLLM.")
    echo: bool = False
    logprobs: int | None = Field(default=None, description="Top logprobs per token (0: the sampled token's only).")

    @field_validator("prompt")
    @classmethod
    def _nonempty(cls, v):
        if (isinstance(v, str) and not v) or (isinstance(v, list) and (not v or any(
                (isinstance(p, (str, list)) and not p) for p in v))):
            raise ValueError("prompt must not be empty")
        return v

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v):
        if v is not None and v < -1:
            raise BadRequestError("`logprobs` must be a positive value or -1.", param="logprobs")
        return v

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


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def to_message(self) -> ChatMessage:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return ChatMessage(role="system" if self.role == "developer" else self.role, content=text)


class ChatCompletionRequest(_Common):
    messages: list[ChatIn] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=0, description="With logprobs: this many top tokens per position.")

    @model_validator(mode="after")
    def _top_logprobs(self):
        t = self.top_logprobs
        if t is not None and t < -1:
            raise BadRequestError("`top_logprobs` must be a positive value or -1.", param="top_logprobs")
        if t and not self.logprobs:
            raise BadRequestError("when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs")
        if (self.model_extra or {}).get("echo"):
            raise BadRequestError("`echo` is not supported by llmpipe for chat", param="echo")
        if (self.model_extra or {}).get("add_generation_prompt") is False:
            raise BadRequestError("`add_generation_prompt` is not supported by llmpipe", param="add_generation_prompt")
        return self

    def sample_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class UsageOut(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


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


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


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
