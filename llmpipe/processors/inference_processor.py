"""TokenizedRequest -> Generation, through the batcher and the engine."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from llmpipe.batching import Batcher
from llmpipe.engines.base import Engine, EngineOutput, EngineRequest, TokenCallback
from llmpipe.errors import EngineError, ExpiredError
from llmpipe.isolation import run_isolated
from llmpipe.messages import FinishReason, Generation, Stage, StageError, TokenizedRequest
from llmpipe.processors.envelope import WallClock, run_stage

log = logging.getLogger("llmpipe.inference")


@dataclass(frozen=True)
class _Done:
    output: EngineOutput
    batch_size: int
    engine_time_s: float


class InferenceProcessor:
    """Owns the batcher in front of one engine. One per inference worker process."""

    def __init__(
        self,
        engine: Engine,
        *,
        window_s: float,
        max_size: int,
        company_expected: Callable[[], bool] | None = None,
        on_batch: Callable[[int, float], None] | None = None,
        on_tokens: TokenCallback | None = None,
        retry_attempts: int = 3,
        clock: WallClock = time.time,
    ):
        self.engine = engine
        self._clock = clock
        self._on_tokens = on_tokens
        self._attempts = retry_attempts
        # A continuous engine takes new requests while a batch runs: keep a few batches in
        # flight so arrivals join vLLM's running batch instead of waiting for it to end.
        self.batcher: Batcher[TokenizedRequest] = Batcher(
            self._run_batch,
            window_s=window_s,
            max_size=max_size,
            concurrent_batches=4 if engine.continuous else 1,
            company_expected=company_expected,
            on_batch=on_batch,
        )

    def process(self, req: TokenizedRequest) -> Generation:
        return run_stage(Stage.INFERENCE, req, self._generate, self._failed, self._clock)

    def _generate(self, req: TokenizedRequest) -> Generation:
        fut = self.batcher.submit(req)
        try:
            done: _Done = fut.result(timeout=max(0.0, req.deadline - self._clock()))
        except FutureTimeout:
            self.engine.abort([req.request_id])
            raise ExpiredError("job deadline passed during inference") from None
        out = done.output
        return Generation(
            job_id=req.job_id, index=req.index, deadline=req.deadline, enqueued_at=req.enqueued_at,
            prompt_tokens=len(req.prompt_token_ids), output_token_ids=out.token_ids,
            finish_reason=out.finish_reason, batch_size=done.batch_size,
            engine_time_s=done.engine_time_s, first_token_at=out.first_token_at,
        )

    def _run_batch(self, batch: list[TokenizedRequest]) -> list[_Done | Exception]:
        now = self._clock()
        results: list[_Done | Exception | None] = [None] * len(batch)
        live: list[tuple[int, EngineRequest]] = []
        for i, r in enumerate(batch):
            if now >= r.deadline:
                # Expired work never reaches the engine.
                results[i] = ExpiredError("job deadline passed before the engine started it")
            else:
                live.append((i, EngineRequest(r.request_id, r.prompt_token_ids, r.params)))
        if live:
            t0 = time.monotonic()
            outs = run_isolated(
                lambda reqs: self.engine.generate(reqs, self._on_tokens), [er for _, er in live], attempts=self._attempts
            )
            dt = time.monotonic() - t0
            for (i, _), out in zip(live, outs, strict=True):
                results[i] = out if isinstance(out, Exception) else _Done(out, len(live), dt)
        return results  # type: ignore[return-value]

    @staticmethod
    def _failed(req: TokenizedRequest, error: StageError) -> Generation:
        finish = FinishReason.EXPIRED if error.reason == "expired" else FinishReason.ERROR
        return Generation(
            job_id=req.job_id, index=req.index, deadline=req.deadline, enqueued_at=req.enqueued_at,
            prompt_tokens=len(req.prompt_token_ids), finish_reason=finish, error=error,
        )

    def shutdown(self) -> None:
        self.batcher.stop()


__all__ = ["InferenceProcessor", "EngineError"]
