"""The one small interface every inference engine implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from llmpipe.messages import FinishReason, Logprob, SamplingParams

# Called from the engine with (request_id, all output token ids so far) as tokens arrive.
TokenCallback = Callable[[str, list[int]], None]


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # vLLM's: lower is scheduled sooner (llmpipe/jobs/lanes.py)


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
    # What the engine can do beyond plain sampling; a request asking for more is refused.
    supports_logprobs: bool = False
    supports_structured_outputs: bool = False

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
