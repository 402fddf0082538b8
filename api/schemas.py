"""HTTP request and response bodies of the polling job API."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmpipe.messages import ChatMessage, ErrorReason, JobResult, JobStatus, SamplingParams


class JobCreate(BaseModel):
    """Exactly one of ``prompt``, ``prompts`` or ``messages``."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | None = Field(default=None, min_length=1, description="One plain-text prompt.")
    prompts: list[str] | None = Field(default=None, min_length=1, description="Several prompts, answered in order.")
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, description="A chat; the model's chat template applies.")
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop_token_ids: list[int] = Field(default_factory=list, max_length=64)
    ignore_eos: bool = False
    timeout: float | None = Field(default=None, gt=0, description="Seconds until the job expires; capped by the server.")

    @model_validator(mode="after")
    def _one_input(self) -> JobCreate:
        given = [n for n in ("prompt", "prompts", "messages") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError("exactly one of prompt, prompts or messages is required" + (f" (got {', '.join(given)})" if given else ""))
        if self.prompts is not None and any(not p for p in self.prompts):
            raise ValueError("prompts must not contain empty strings")
        return self

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens or default_max_tokens, temperature=self.temperature, top_p=self.top_p,
            seed=self.seed, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
        )


class JobCreated(BaseModel):
    id: str
    status: JobStatus
    status_url: str


class ErrorBody(BaseModel):
    type: ErrorReason
    message: str
    param: str | None = None
    stage: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class JobView(BaseModel):
    id: str
    status: JobStatus
    created_at: float
    deadline: float
    prompts: int
    partial: list[str] | None = Field(default=None, description="Text produced so far, per prompt, while the job runs.")
    result: JobResult | None = None
    error: ErrorBody | None = None
