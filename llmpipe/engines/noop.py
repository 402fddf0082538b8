"""An engine that does no work, to measure the pipeline's own overhead."""

from __future__ import annotations

import time

from llmpipe.engines.base import EXTRA_SAMPLING, Engine, EngineOutput, EngineRequest, TokenCallback
from llmpipe.messages import FinishReason


class NoopEngine(Engine):
    """Returns ``max_tokens`` copies of the last prompt token at once, finish LENGTH.

    Stop ids and EOS are ignored: every request costs exactly ``max_tokens`` tokens.
    """

    name = "noop"
    continuous = True
    unsupported_params = EXTRA_SAMPLING  # it samples nothing

    def __init__(self, max_model_len: int | None = None) -> None:
        self._max_model_len = max_model_len
        self.requests = 0

    @property
    def max_model_len(self) -> int | None:
        return self._max_model_len

    def generate(self, batch: list[EngineRequest], on_tokens: TokenCallback | None = None) -> list[EngineOutput]:
        now = time.time()
        outputs = []
        for r in batch:
            last = r.prompt_token_ids[-1] if r.prompt_token_ids else 0
            tokens = [last] * r.params.max_tokens
            if on_tokens is not None:
                on_tokens(r.request_id, list(tokens))
            outputs.append(EngineOutput(r.request_id, tokens, FinishReason.LENGTH, first_token_at=now))
        self.requests += len(batch)
        return outputs

    def stats(self) -> dict[str, float]:
        return {"requests": float(self.requests)}

    def shutdown(self) -> None:
        pass
