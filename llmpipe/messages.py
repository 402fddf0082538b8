"""Every message that crosses a stage boundary, in one module.

The chain for one prompt is::

    PromptRequest --preprocess--> TokenizedRequest --inference--> Generation
                  --postprocess--> PromptResult   (collected into a JobResult)

Messages travel as JSON (``model_dump(mode="json")``) so that Flower shows them and no
worker ever unpickles. A request that fails in a stage keeps flowing down the chain with
``error`` set, so one bad prompt never sinks the other prompts of its job.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# The stages are owned by llmpipe/stages.py; the messages name theirs with it, and
# ``from llmpipe.messages import Stage`` keeps working.
from llmpipe.stages import Stage


class FinishReason(StrEnum):
    """Why a prompt's generation ended. Part of the public API."""

    STOP = "stop"  # an EOS or stop token
    LENGTH = "length"  # max_tokens reached
    ERROR = "error"  # see the result's ``error``
    CANCELLED = "cancelled"
    EXPIRED = "expired"


class ErrorReason(StrEnum):
    """Why a request or job failed. Part of the public API (``error.type``)."""

    INVALID_REQUEST = "invalid_request"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    LIMIT_EXCEEDED = "limit_exceeded"
    ENGINE_ERROR = "engine_error"
    OVERLOADED = "overloaded"
    EXPIRED = "expired"
    CANCELLED = "cancelled"
    UNAVAILABLE = "unavailable"
    NOT_FOUND = "not_found"
    MODEL_NOT_FOUND = "model_not_found"  # the request names a model this server does not serve (OpenAI's code)
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    INTERNAL = "internal_error"
    IDEMPOTENCY_KEY_REUSED = "idempotency_key_reused"  # the same Idempotency-Key with a different body
    IDEMPOTENCY_KEY_IN_USE = "idempotency_key_in_use"  # the first request with this key is still being admitted


class JobStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self not in (JobStatus.QUEUED, JobStatus.RUNNING)


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StageError(_Msg):
    reason: ErrorReason
    message: str
    stage: Stage | None = None
    param: str | None = None  # the request field at fault, when one is


class StructuredOutput(_Msg):
    """One constraint of vLLM's structured outputs (``response_format``, ``structured_outputs``,
    a ``tool_choice`` that forces a call): exactly one of the constraint fields, plus vLLM's options."""

    json_object: bool = False
    json_schema: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None  # vLLM's JSON text
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


class SamplingParams(_Msg):
    """vLLM's SamplingParams, as far as llmpipe carries them; defaults ask for nothing.
    The API checks values with vLLM's rules and messages (api/openai/sampling.py)."""

    max_tokens: int = Field(default=64, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # 0 or -1: off
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    seed: int | None = None
    stop_token_ids: list[int] = Field(default_factory=list, max_length=64)
    # Stop strings need text, so postprocess applies them after detokenizing.
    stop: list[str] = Field(default_factory=list, max_length=16)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    # Token id -> bias, clamped to [-100, 100] (vLLM).
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = Field(default_factory=list)
    # The token-id sequences bad_words forbid, tokenized by preprocess as vLLM does (the
    # transformers engine reads them; vLLM tokenizes bad_words itself).
    bad_words_token_ids: list[list[int]] | None = None
    # Detokenizing, applied in postprocess and in the API's live decode.
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Log probabilities, as vLLM's SamplingParams: the sampled token's plus this many
    # top ones per generated token (0: the sampled token's only; -1: the whole vocabulary);
    # per prompt token too.
    logprobs: int | None = Field(default=None, ge=-1)
    prompt_logprobs: int | None = Field(default=None, ge=-1)
    # Return the prompt's token ids and text with the result (OpenAI's ``echo``).
    echo: bool = False
    structured: StructuredOutput | None = None
    # Preprocess keeps only this many of the prompt's last (truncation_side "left", vLLM's
    # default) or first tokens; -1: the model's context length.
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None


class Logprob(_Msg):
    """One token's log probability at one position. A position is a list of these: the
    sampled (or prompt) token first, then the top ones not already listed, by rank, as
    vLLM orders them. ``logprob`` is None only for the first prompt token, which nothing
    precedes. ``token`` is the token's text, filled in by postprocess."""

    id: int
    logprob: float | None = None
    rank: int | None = None
    token: str | None = None


class FunctionCall(_Msg):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Msg):
    """A tool call: one the assistant made earlier in the conversation, or one parsed out of
    the output (postprocess)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Msg):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool result's
    reasoning: str | None = None  # an assistant's, for templates that show it (vLLM's interleaved thinking)


class ChatTemplate(_Msg):
    """How preprocess renders ``messages``: vLLM's chat template fields, passed to the
    tokenizer's apply_chat_template as vLLM passes them."""

    tools: list[dict] | None = None  # OpenAI's tool objects ({"type": "function", "function": {...}})
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None  # the request's own (only with trust_request_chat_template)
    kwargs: dict[str, Any] = Field(default_factory=dict)  # chat_template_kwargs, reasoning_effort, enable_thinking
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # on top of the template's own, as vLLM's chat field


class OutputParsing(_Msg):
    """What the model's parsers (vLLM's tool-call and reasoning parsers, named by the served
    model's settings) need of a chat request: preprocess adjusts the request with them,
    inference parses a stream with them, postprocess parses the final output."""

    tools: list[dict] | None = None
    tool_choice: str | dict | None = "none"  # "none", "auto", "required" or {"type": "function", "function": {"name": ...}}
    parallel_tool_calls: bool | None = True
    include_reasoning: bool = True
    template_kwargs: dict[str, Any] = Field(default_factory=dict)  # the chat template kwargs the parsers see
    prompt_token_ids: list[int] | None = None  # the prompt, for parsers that read it (inference sets it)


class StageTiming(_Msg):
    """Wall-clock stamps (epoch seconds) so that they compare across processes."""

    stage: Stage
    enqueued_at: float
    started_at: float
    finished_at: float

    @property
    def queue_wait_s(self) -> float:
        return max(0.0, self.started_at - self.enqueued_at)

    @property
    def run_s(self) -> float:
        return max(0.0, self.finished_at - self.started_at)


class _Envelope(_Msg):
    """Fields every per-prompt message carries down the chain."""

    job_id: str
    index: int = Field(ge=0)
    deadline: float  # epoch seconds; every stage checks it before working
    enqueued_at: float  # when this message was sent to its current stage
    timings: list[StageTiming] = Field(default_factory=list)
    error: StageError | None = None
    stream: bool = False  # publish tokens as they are produced (SSE clients)
    # vLLM's priority (lower is sooner): picks the lane (llmpipe/jobs/lanes.py), orders the
    # inference batcher and goes to the engine.
    priority: int = 0
    # The served model's name (llmpipe/models/served.py): the CPU stages pick its tokenizer,
    # and the API sent the inference task to its queue. None: the default (first) model.
    model: str | None = None

    @property
    def request_id(self) -> str:
        return f"{self.job_id}-{self.index}"


class PromptRequest(_Envelope):
    """API -> preprocess: one prompt of a job, before tokenization (or already as token
    ids, which preprocess only validates)."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    prompt_token_ids: list[int] | None = None
    params: SamplingParams
    chat: ChatTemplate | None = None  # with messages
    parsing: OutputParsing | None = None  # a chat request's

    @model_validator(mode="after")
    def _one_input(self) -> PromptRequest:
        if sum(x is not None for x in (self.prompt, self.messages, self.prompt_token_ids)) != 1:
            raise ValueError("exactly one of prompt, messages or prompt_token_ids is required")
        return self


class TokenizedRequest(_Envelope):
    """preprocess -> inference: token ids in, so the engine never tokenizes."""

    prompt_token_ids: list[int]
    params: SamplingParams
    parsing: OutputParsing | None = None  # when the model's parsers apply (preprocess decides)
    # vLLM's reasoning_ended: whether a structured output constrains from the first token
    # (None: the engine's reasoning parser decides), as vLLM's chat server computes it.
    reasoning_ended: bool | None = None


class Detokenizing(_Msg):
    """The sampling parameters postprocess detokenizes with (vLLM's detokenizer's)."""

    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    min_tokens: int = 0  # stop strings are not checked before this many tokens

    @classmethod
    def of(cls, p: SamplingParams) -> Detokenizing:
        return cls(skip_special_tokens=p.skip_special_tokens, spaces_between_special_tokens=p.spaces_between_special_tokens,
                   include_stop_str_in_output=p.include_stop_str_in_output, min_tokens=p.min_tokens)


class Parsed(_Msg):
    """A chat output split by the model's parsers, as vLLM's chat server answers it."""

    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    reasoning_tokens: int = 0
    # The answer's finish_reason is "tool_calls" (vLLM's rule: auto found calls, or required
    # stopped); the result's finish_reason stays the engine's, which a stream's rule reads.
    tools_called: bool = False


class Generation(_Envelope):
    """inference -> postprocess: token ids out."""

    prompt_tokens: int
    output_token_ids: list[int] = Field(default_factory=list)
    finish_reason: FinishReason = FinishReason.ERROR
    batch_size: int = 0
    engine_time_s: float = 0.0
    first_token_at: float | None = None
    stop: list[str] = Field(default_factory=list)  # stop strings, applied in postprocess
    # The engine's stop token id (None: EOS, or not stopped by a token), as vLLM's stop_reason.
    stop_token: int | None = None
    # The prompt's last few ids: postprocess decodes the output after them, as vLLM does
    # (a first token's leading space depends on what precedes it).
    prompt_tail: list[int] = Field(default_factory=list)
    # Only when the request asked: the whole prompt (echo) and the log probabilities.
    prompt_token_ids: list[int] | None = None
    logprobs: list[list[Logprob]] | None = None
    prompt_logprobs: list[list[Logprob]] | None = None
    # Detokenizing options and the parsing of a chat request, for postprocess.
    detok: Detokenizing = Field(default_factory=lambda: Detokenizing())
    parsing: OutputParsing | None = None


class StageTimingSummary(_Msg):
    queue_wait_s: float
    run_s: float


class PromptResult(_Msg):
    """postprocess -> collect: the finished output of one prompt."""

    index: int
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: FinishReason
    timings: dict[Stage, StageTimingSummary] = Field(default_factory=dict)
    batch_size: int = 0
    engine_time_s: float = 0.0
    # When the engine emitted the first output token (epoch seconds; None: none came).
    first_token_at: float | None = None
    error: StageError | None = None
    # vLLM's stop_reason: the stop string or stop token id that ended the output (None: EOS).
    stop_reason: int | str | None = None
    # Only when the request asked: echo (the prompt's ids and text) and log probabilities
    # with each token's text.
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None
    logprobs: list[list[Logprob]] | None = None
    prompt_logprobs: list[list[Logprob]] | None = None
    # A chat request's output as the model's parsers split it (None: no parser applies;
    # ``text`` is the content).
    parsed: Parsed | None = None


class Usage(_Msg):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class JobResult(_Msg):
    """The chord callback's value: every prompt of the job, in order."""

    job_id: str
    status: JobStatus
    results: list[PromptResult]
    usage: Usage
    error: StageError | None = None
