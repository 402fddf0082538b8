"""vLLM's sampling fields beyond the basics, on both OpenAI endpoints, with vLLM's own rules
and messages: the limits are stated in the OpenAPI schema and checked by :func:`check`
(not by pydantic, whose messages differ from vLLM's), in the order of vLLM's
``SamplingParams._verify_args``. tests/llmpipe/parsing/test_vllm_messages.py runs a table
of bad values through vLLM's own SamplingParams and through :func:`check`, so the two
cannot drift apart.

What needs the model (a token id in the vocabulary, a bad word that tokenizes to nothing,
truncation longer than the context) is checked by preprocess, with vLLM's messages too.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from api.validation import Bool, Float, InVocab, Int, TokenId, current
from llmpipe.errors import BadRequestError
from llmpipe.messages import Detokenizing, SamplingParams
from llmpipe.processors.prompt_checks import check_vocab


def _limits(**kw: Any) -> Any:
    """Schema keywords for a limit that :func:`check` enforces with vLLM's message."""
    return {"json_schema_extra": kw}


class SamplingFields(BaseModel):
    """vLLM's extra sampling parameters (its CompletionRequest and ChatCompletionRequest have them all)."""

    presence_penalty: Float() | None = Field(default=None, **_limits(minimum=-2, maximum=2),
                                             description="-2 to 2; penalizes tokens already in the output.")
    frequency_penalty: Float() | None = Field(default=None, **_limits(minimum=-2, maximum=2),
                                              description="-2 to 2; penalizes tokens by their count in the output.")
    repetition_penalty: Float() | None = Field(default=None, **_limits(exclusiveMinimum=0),
                                               description="vLLM: > 0; 1 is off; over prompt and output tokens.")
    top_k: Int() | None = Field(default=None, **_limits(minimum=-1),
                                description="vLLM: the top k tokens only; 0 or -1: all.")
    min_p: Float() | None = Field(default=None, **_limits(minimum=0, maximum=1),
                                  description="vLLM: 0 to 1; tokens less likely than min_p times the top one are dropped.")
    logit_bias: Annotated[dict[str, Float()], InVocab("key")] | None = Field(
        default=None, description="Token id (as a string) -> bias added to its logit, clamped to [-100, 100].")
    min_tokens: Int() = Field(default=0, **_limits(minimum=0),
                              description="vLLM: no EOS, stop token or stop string before this many tokens.")
    bad_words: list[str] = Field(default_factory=list, **_limits(items={"type": "string", "minLength": 1}),
                                 description="vLLM: words the output never contains.")
    allowed_token_ids: list[Annotated[TokenId, InVocab()]] | None = Field(default=None, **_limits(minItems=1),
                                                    description="vLLM: only these tokens are sampled.")
    include_stop_str_in_output: Bool = Field(default=False, description="vLLM: keep the stop string (or token) text.")
    skip_special_tokens: Bool = Field(default=True, description="vLLM: leave special tokens out of the text.")
    spaces_between_special_tokens: Bool = Field(default=True, description="vLLM: spaces between special tokens.")
    truncate_prompt_tokens: Int(ge=-1) | None = Field(
        default=None,
        description="vLLM: keep only this many prompt tokens (-1: the context length less one).")
    truncation_side: Literal["left", "right"] | None = Field(
        default=None, description="vLLM: left keeps the last tokens, right the first; default: the tokenizer's.")

    def detokenizing(self) -> Detokenizing:
        """The detokenizing options, for the API's live decode of a stream."""
        return Detokenizing(skip_special_tokens=self.skip_special_tokens,
                            spaces_between_special_tokens=self.spaces_between_special_tokens,
                            include_stop_str_in_output=self.include_stop_str_in_output, min_tokens=self.min_tokens)

    def vllm_params(self) -> dict[str, Any]:
        """These fields as SamplingParams arguments, unset ones at vLLM's defaults."""
        return {
            "presence_penalty": self.presence_penalty or 0.0, "frequency_penalty": self.frequency_penalty or 0.0,
            "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
            "top_k": self.top_k or 0, "min_p": self.min_p or 0.0, "min_tokens": self.min_tokens,
            "logit_bias": self.bias(), "bad_words": list(dict.fromkeys(self.bad_words)),
            "allowed_token_ids": self.allowed_token_ids, "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "truncate_prompt_tokens": self.truncate_prompt_tokens, "truncation_side": self.truncation_side,
        }

    def bias(self) -> dict[int, float] | None:
        """``logit_bias`` with vLLM's conversion: integer keys, biases clamped to [-100, 100]."""
        if self.logit_bias is None:
            return None
        return {int(k): min(100.0, max(-100.0, v)) for k, v in self.logit_bias.items()}


def check(req: SamplingFields, *, max_tokens: int | None) -> None:
    """vLLM's SamplingParams checks of these fields, in its order and with its messages (the
    field named as ``param``). ``max_tokens``: the effective one (None: not known here)."""
    if req.presence_penalty is not None and not -2.0 <= req.presence_penalty <= 2.0:
        _bad(f"presence_penalty must be in [-2, 2], got {req.presence_penalty}.", "presence_penalty")
    if req.frequency_penalty is not None and not -2.0 <= req.frequency_penalty <= 2.0:
        _bad(f"frequency_penalty must be in [-2, 2], got {req.frequency_penalty}.", "frequency_penalty")
    rp = req.repetition_penalty
    if rp is not None and not math.isfinite(rp):
        _bad(f"repetition_penalty must be a finite number, got {rp}.", "repetition_penalty")
    if rp is not None and rp <= 0.0:
        _bad(f"repetition_penalty must be greater than zero, got {rp}.", "repetition_penalty")
    if req.top_k is not None and req.top_k < -1:
        _bad(f"top_k must be 0 (disable), or at least 1, got {req.top_k}.", "top_k")
    if req.min_p is not None and not 0.0 <= req.min_p <= 1.0:
        _bad(f"min_p must be in [0, 1], got {req.min_p}.", "min_p")
    if req.min_tokens < 0:
        _bad(f"min_tokens must be greater than or equal to 0, got {req.min_tokens}.", "min_tokens")
    if max_tokens is not None and req.min_tokens > max_tokens:
        _bad(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {req.min_tokens}.", "min_tokens")
    if any(not w for w in req.bad_words):
        _bad(f"bad_words cannot contain an empty string. Got bad_words={list(dict.fromkeys(req.bad_words))}",
             "bad_words")
    if req.logit_bias:
        invalid = [k for k in req.logit_bias if not _is_int(k)]
        if invalid:
            _bad(f"logit_bias contains key(s) that cannot be converted to integer token IDs: {invalid!r}", "logit_bias")
    if req.allowed_token_ids is not None and not req.allowed_token_ids:
        _bad("allowed_token_ids is not None and empty!", "allowed_token_ids")


def _is_int(key: str) -> bool:
    try:
        int(key)
    except (TypeError, ValueError):
        return False
    return True


def _bad(message: str, param: str) -> None:
    raise BadRequestError(message, param=param)


def in_vocab(p: SamplingParams) -> SamplingParams:
    """``p``, once its token ids are in the vocabulary the schema states (vLLM's messages;
    preprocess checks them again against the request's own model)."""
    top = current().value("max_token_id")
    if top is not None:
        check_vocab(p, top + 1)
    return p
