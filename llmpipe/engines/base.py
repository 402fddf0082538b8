"""The one small interface every inference engine implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from llmpipe.messages import FinishReason, Logprob, SamplingParams

# Called from the engine with (request_id, all output token ids so far) as tokens arrive.
TokenCallback = Callable[[str, list[int]], None]


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # vLLM's: lower is scheduled sooner (llmpipe/jobs/lanes.py)
    reasoning_ended: bool | None = None  # vLLM's: a grammar applies from the first token (None: its reasoner decides)


@dataclass
class EngineOutput:
    request_id: str
    token_ids: list[int]
    finish_reason: FinishReason
    first_token_at: float | None = None  # epoch seconds, when the engine knows it
    extra: dict = field(default_factory=dict)
    # When the request asked (params.logprobs / params.prompt_logprobs): one list per
    # position, as llmpipe.messages.Logprob describes; prompt positions start at the first token.
    logprobs: list[list[Logprob]] | None = None
    prompt_logprobs: list[list[Logprob]] | None = None
    stop_token: int | None = None  # the stop_token_ids id that ended it (not EOS)


class Engine(ABC):
    """Token ids in, token ids out. Implementations never tokenize.

    ``generate`` is blocking and thread-safe. An engine with ``continuous = True``
    accepts a new batch while another is still running (vLLM joins it into the running
    batch); otherwise the caller runs one batch at a time.
    """

    name: str = "engine"
    continuous: bool = False
    # What the engine can do beyond plain sampling; a request asking for more is refused
    # (refusal() below; the API checks it before enqueuing, the inference stage again).
    supports_logprobs: bool = False
    supports_structured_outputs: bool = False
    # SamplingParams fields this engine cannot honour: a request that sets one to anything
    # but its default is refused, naming the field and the engine, never run without it.
    unsupported_params: ClassVar[frozenset[str]] = frozenset()

    @abstractmethod
    def generate(self, batch: list[EngineRequest], on_tokens: TokenCallback | None = None) -> list[EngineOutput]:
        """Run ``batch``; return one output per request, in order. Raise EngineError on failure."""

    def abort(self, request_ids: list[str]) -> None:  # noqa: B027 - optional
        """Stop generating for these requests, if they are running."""

    @property
    def max_model_len(self) -> int | None:
        return None

    def stats(self) -> dict[str, float]:
        """Engine-level gauges (running, waiting, kv cache use) where the engine has them."""
        return {}

    @abstractmethod
    def shutdown(self) -> None:
        """Release the model and any child process."""


# The sampling fields beyond plain sampling (temperature, top_p, seed, stop ids and strings,
# max_tokens, ignore_eos), which an engine declares in unsupported_params when it lacks one.
EXTRA_SAMPLING = frozenset({
    "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "logit_bias",
    "allowed_token_ids", "bad_words",
})


def refusal(engine: Engine | type[Engine], p: SamplingParams) -> tuple[str, str] | None:
    """(field, message) for the first thing ``p`` asks that ``engine`` cannot do; None if it can."""
    if p.logprobs is not None and not engine.supports_logprobs:
        return "logprobs", f"the {engine.name} engine does not return log probabilities"
    if p.prompt_logprobs is not None and not engine.supports_logprobs:
        return "prompt_logprobs", f"the {engine.name} engine does not return log probabilities"
    if p.structured is not None and not engine.supports_structured_outputs:
        return "structured", (f"the {engine.name} engine has no structured outputs (guided decoding needs the vllm "
                              "engine)")
    fields = SamplingParams.model_fields
    for name in sorted(engine.unsupported_params):
        if getattr(p, name) != fields[name].get_default(call_default_factory=True):
            return name, f"{name} is not supported by the {engine.name} engine"
    return None
