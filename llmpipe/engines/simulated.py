"""SIMULATED GPU engine: a cost model that sleeps; it computes nothing.

For benchmarks of the pipeline on machines without a GPU. A batch "runs" for::

    prefill_s_per_token * sum(prompt tokens) + steps * step_s(batch_size)
    step_s(b) = step_base_s + step_per_seq_s * (b - 1)

where ``steps`` is the longest output in the batch (``max_tokens`` unless a stop id cut
it short). Batches larger than ``max_batch_size`` run as consecutive chunks. The thread
sleeps, so it uses no CPU. Output ids are deterministic: the prompt's ids, cycled (so they
are valid ids for whatever tokenizer made the prompt).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from llmpipe.engines.base import Engine, EngineOutput, EngineRequest, TokenCallback
from llmpipe.messages import FinishReason


@dataclass(frozen=True)
class SimulatedGpuCost:
    """Costs of a small model on one GPU. Defaults: one 512-token prompt with 64 output
    tokens takes 51.2 ms prefill + 64 * 4.6 ms decode = ~346 ms; 32 such prompts in one
    batch take ~2.2 s (~14 requests/s against ~2.9 one at a time)."""

    prefill_s_per_token: float = 0.0001
    step_base_s: float = 0.0046
    step_per_seq_s: float = 0.00015
    max_batch_size: int = 64

    def step_s(self, batch_size: int) -> float:
        return self.step_base_s + self.step_per_seq_s * max(0, batch_size - 1)

    def chunk_s(self, prompt_tokens: list[int], output_tokens: list[int]) -> float:
        """Seconds for one chunk (at most ``max_batch_size`` requests)."""
        if not prompt_tokens:
            return 0.0
        return self.prefill_s_per_token * sum(prompt_tokens) + max(output_tokens) * self.step_s(len(prompt_tokens))

    def batch_s(self, prompt_tokens: list[int], output_tokens: list[int]) -> float:
        """Seconds for a batch of any size, run in chunks of ``max_batch_size``."""
        m = self.max_batch_size
        return sum(
            self.chunk_s(prompt_tokens[i : i + m], output_tokens[i : i + m]) for i in range(0, len(prompt_tokens), m)
        )

    def theoretical_capacity_rps(self, prompt_tokens: int, max_tokens: int, batch_size: int) -> float:
        """Requests per second with full batches of identical requests, back to back."""
        b = max(1, batch_size)
        return b / self.batch_s([prompt_tokens] * b, [max_tokens] * b)


class SimulatedGpuEngine(Engine):
    name = "simulated-gpu"
    continuous = False

    def __init__(
        self,
        cost: SimulatedGpuCost | None = None,
        *,
        max_model_len: int | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cost = cost or SimulatedGpuCost()
        self._max_model_len = max_model_len
        self._sleep = sleep
        self._clock = clock
        self._lock = threading.Lock()  # one batch on the "GPU" at a time
        self.batches = 0
        self.requests = 0
        self.busy_s = 0.0

    @property
    def max_model_len(self) -> int | None:
        return self._max_model_len

    @staticmethod
    def _tokens(r: EngineRequest) -> tuple[list[int], FinishReason]:
        prompt = r.prompt_token_ids or [0]
        stops = set(r.params.stop_token_ids)
        out: list[int] = []
        for i in range(r.params.max_tokens):
            tok = prompt[i % len(prompt)]
            out.append(tok)
            if tok in stops:
                return out, FinishReason.STOP
        return out, FinishReason.LENGTH

    def generate(self, batch: list[EngineRequest], on_tokens: TokenCallback | None = None) -> list[EngineOutput]:
        outputs: list[EngineOutput] = []
        m = self.cost.max_batch_size
        with self._lock:
            for start in range(0, len(batch), m):
                chunk = batch[start : start + m]
                results = [self._tokens(r) for r in chunk]
                prompt_lens = [len(r.prompt_token_ids) for r in chunk]
                out_lens = [len(toks) for toks, _ in results]
                t0 = self._clock()
                # Prefill and the first step, then the rest of the decode.
                first = self.cost.prefill_s_per_token * sum(prompt_lens) + self.cost.step_s(len(chunk))
                total = self.cost.chunk_s(prompt_lens, out_lens)
                self._sleep(first)
                first_at = time.time()
                self._sleep(max(0.0, total - first))
                self.busy_s += self._clock() - t0
                self.batches += 1
                self.requests += len(chunk)
                for r, (toks, reason) in zip(chunk, results, strict=True):
                    if on_tokens is not None:
                        on_tokens(r.request_id, list(toks))
                    outputs.append(EngineOutput(r.request_id, toks, reason, first_token_at=first_at, extra={"simulated": True}))
        return outputs

    def stats(self) -> dict[str, float]:
        return {"batches": float(self.batches), "requests": float(self.requests), "busy_s": self.busy_s}

    def shutdown(self) -> None:
        pass
