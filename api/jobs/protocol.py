"""HTTP request and response bodies of the polling job API."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from api.errors import ErrorBody
from api.openai import sampling
from api.openai.chat import CHAT_RULES, ChatFields, check_generation_prompt, check_tool_usage
from api.openai.sampling import SamplingFields
from api.validation import Bool, Float, InVocab, Int, Limit, Priority, Seed, TokenId
from llmpipe.messages import ChatMessage, JobResult, JobStatus, SamplingParams


class _JobParams(SamplingFields):
    """The job API's sampling parameters: the basics and vLLM's extra ones (api/openai/sampling.py)."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: Int(Limit("max_tokens_limit", param="max_tokens"), ge=1) | None = Field(
        default=None, description="At most max_tokens_limit; default: the server's default_max_tokens.")
    temperature: Float(ge=0.0, le=2.0) = 1.0
    top_p: Float(gt=0.0, le=1.0) = 1.0
    seed: Seed | None = None
    stop_token_ids: list[Annotated[TokenId, InVocab()]] = Field(default_factory=list, max_length=64)
    ignore_eos: Bool = False
    timeout: Float(gt=0) | None = Field(default=None, description="Seconds until the job expires; capped by the server (max_timeout_s).")
    priority: Priority = 0
    model: str | None = Field(default=None, description=(
        "A served model (GET /v1/models lists them); default: the first. One not served is 404 model_not_found."))

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        max_tokens = self.max_tokens or default_max_tokens
        sampling.check(self, max_tokens=max_tokens)
        return sampling.in_vocab(SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            seed=self.seed, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            **self.vllm_params(),
        ))


# A prompt's text: not empty, at most max_prompt_chars characters.
PromptText = Annotated[str, Field(min_length=1), Limit("max_prompt_chars", "length", param="prompt")]


class JobMessage(ChatMessage):
    """A message of the chat: any role, the ``tool`` role (with ``tool_call_id``) and an
    assistant's ``tool_calls`` included."""

    content: Annotated[str, Limit("max_prompt_chars", "length", param="messages")] | None = None


class JobPrompt(_JobParams):
    """One plain-text prompt."""

    prompt: PromptText
    prompts: None = None
    messages: None = None


class JobPrompts(_JobParams):
    """Several prompts, answered in order."""

    prompts: Annotated[list[PromptText], Field(min_length=1), Limit("max_prompts_per_job", "items", param="prompts")]
    prompt: None = None
    messages: None = None


class JobMessages(ChatFields, _JobParams):
    """A chat; the model's chat template applies, with the tools and the chat template's
    fields of the OpenAI chat endpoint; the model's parsers split each result (``parsed``)."""

    model_config = ConfigDict(json_schema_extra={"allOf": CHAT_RULES})

    messages: list[JobMessage] = Field(min_length=1)
    prompt: None = None
    prompts: None = None

    @model_validator(mode="before")
    @classmethod
    def _vllm_before(cls, data: Any) -> Any:
        return check_generation_prompt(check_tool_usage(data))


_INPUTS = {"prompt": "JobPrompt", "prompts": "JobPrompts", "messages": "JobMessages"}
UNION_TAGS = frozenset(_INPUTS.values())  # in a validation error's loc; api/errors.py leaves them out


def _which_input(body: Any) -> str | None:
    get = body.get if isinstance(body, dict) else lambda k: getattr(body, k, None)
    given = [k for k in _INPUTS if get(k) is not None]
    return _INPUTS[given[0]] if len(given) == 1 else None


# The body of POST /v1/jobs: exactly one of prompt, prompts or messages (oneOf in the schema).
JobCreate = Annotated[
    Annotated[JobPrompt, Tag("JobPrompt")] | Annotated[JobPrompts, Tag("JobPrompts")]
    | Annotated[JobMessages, Tag("JobMessages")],
    Discriminator(_which_input, custom_error_type="invalid_input",
                  custom_error_message="exactly one of prompt, prompts or messages is required"),
]


class JobCreated(BaseModel):
    id: str
    status: JobStatus
    status_url: str


class JobView(BaseModel):
    id: str
    status: JobStatus
    created_at: float
    deadline: float
    prompts: int
    partial: list[str] | None = Field(default=None, description="Text produced so far, per prompt, while the job runs.")
    result: JobResult | None = None
    error: ErrorBody | None = None
