"""Request and response bodies of vLLM's own endpoints: /tokenize, /detokenize, /version."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from api.openai.protocol import ChatIn
from api.validation import MAX_TOKEN_ID, Bool, Int


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str
    add_special_tokens: Bool = True
    return_token_strs: Bool | None = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    messages: list[ChatIn] = Field(min_length=1)
    add_generation_prompt: Bool = True
    add_special_tokens: Bool = False
    return_token_strs: Bool | None = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    # Larger ids are 400 naming `tokens`, as vLLM answers (no vocabulary is that large).
    tokens: list[Int(ge=0, json_schema_extra={"maximum": MAX_TOKEN_ID})]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str = Field(description="The serving engine's version (vLLM's, with the vllm engine), as vLLM answers.")
    llmpipe_version: str
    engine: Literal["vllm", "transformers", "noop", "simulated"]
