"""TokenizedRequest -> Generation, through the batcher and the engine."""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from llmpipe.batching import Batcher
from llmpipe.engines.base import Engine, EngineOutput, EngineRequest
from llmpipe.errors import BadRequestError, CancelledError, EngineDeadError, ExpiredError
from llmpipe.isolation import run_isolated
from llmpipe.messages import ErrorReason, FinishReason, Generation, Stage, StageError, TokenizedRequest
from llmpipe.processors.envelope import WallClock, run_stage

log = logging.getLogger("llmpipe.inference")

# How many of the prompt's last ids postprocess decodes the output after (as vLLM's
# detokenizer does): enough for a leading space or a character split across tokens.
PROMPT_TAIL = 8


@dataclass(frozen=True)
class _Done:
    output: EngineOutput
    batch_size: int
    engine_time_s: float


class InferenceProcessor:
    """Owns the batcher in front of one engine. One per inference worker process.

    ``publisher`` (a TokenPublisher) receives tokens as the engine makes them;
    ``cancelled_jobs`` answers which of some job ids were cancelled, checked right before
    a batch reaches the engine; ``cancel(job_id)`` aborts a job's requests in the engine.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        window_s: float,
        max_size: int,
        company_expected: Callable[[], bool] | None = None,
        on_batch: Callable[[int, float], None] | None = None,
        publisher=None,
        cancelled_jobs: Callable[[Iterable[str]], set[str]] | None = None,
        retry_attempts: int = 3,
        on_engine_dead: Callable[[BaseException], None] | None = None,
        clock: WallClock = time.time,
    ):
        self.engine = engine
        # Called on the batch thread when the engine is gone (EngineDeadError), before any
        # request hears of it: the worker requeues its messages and exits (workers/context.py).
        self._on_engine_dead = on_engine_dead
        self._clock = clock
        self._publisher = publisher
        self._cancelled_jobs = cancelled_jobs
        self._attempts = retry_attempts
        self._lock = threading.Lock()
        self._running: dict[str, set[str]] = defaultdict(set)  # job id -> request ids in the engine
        # A continuous engine takes new requests while a batch runs, so batches are not
        # serialized: arrivals join vLLM's running batch instead of waiting for it to end.
        # Up to max_size batches may be in flight (batches of one at low load), and vLLM's
        # own scheduler (max_num_seqs) bounds what actually runs.
        self.batcher: Batcher[TokenizedRequest] = Batcher(
            self._run_batch,
            window_s=window_s,
            max_size=max_size,
            concurrent_batches=max_size if engine.continuous else 1,
            company_expected=company_expected,
            on_batch=on_batch,
        )

    def process(self, req: TokenizedRequest) -> Generation:
        return run_stage(Stage.INFERENCE, req, self._generate, self._failed, self._clock)

    def cancel(self, job_id: str) -> list[str]:
        with self._lock:
            ids = list(self._running.get(job_id, ()))
        if ids:
            log.info("job=%s stage=inference aborting %d running requests", job_id, len(ids))
            self.engine.abort(ids)
        return ids

    def _generate(self, req: TokenizedRequest) -> Generation:
        self._check_supported(req)
        if self._publisher is not None:
            self._publisher.register(req.request_id, req.job_id, req.index, req.stream, len(req.prompt_token_ids))
        try:
            fut = self.batcher.submit(req)
            try:
                done: _Done = fut.result(timeout=max(0.0, req.deadline - self._clock()))
            except FutureTimeout:
                self.engine.abort([req.request_id])
                raise ExpiredError("job deadline passed during inference") from None
        finally:
            if self._publisher is not None:
                self._publisher.finish(req.request_id)
        out = done.output
        if out.finish_reason == FinishReason.CANCELLED:
            raise CancelledError("job cancelled while the engine ran it")
        return Generation(
            job_id=req.job_id, index=req.index, deadline=req.deadline, enqueued_at=req.enqueued_at,
            prompt_tokens=len(req.prompt_token_ids), output_token_ids=out.token_ids,
            finish_reason=out.finish_reason, batch_size=done.batch_size,
            engine_time_s=done.engine_time_s, first_token_at=out.first_token_at, stop=req.params.stop,
            stop_token=out.stop_token, prompt_tail=req.prompt_token_ids[-PROMPT_TAIL:],
            prompt_token_ids=req.prompt_token_ids if req.params.echo else None,
            logprobs=out.logprobs, prompt_logprobs=out.prompt_logprobs,
        )

    def _check_supported(self, req: TokenizedRequest) -> None:
        """A request asking for what this engine cannot do fails, naming the field; it is
        never served without it. (The API refuses it first when it knows the engine.)"""
        p, e = req.params, self.engine
        if (p.logprobs is not None or p.prompt_logprobs is not None) and not e.supports_logprobs:
            raise BadRequestError(f"the {e.name} engine does not return log probabilities",
                                  param="logprobs" if p.logprobs is not None else "prompt_logprobs")
        if p.structured is not None and not e.supports_structured_outputs:
            raise BadRequestError(f"the {e.name} engine has no structured outputs (response_format needs the vllm engine)",
                                  param="response_format")

    def _run_batch(self, batch: list[TokenizedRequest]) -> list[_Done | Exception]:
        now = self._clock()
        gone = self._cancelled_jobs([r.job_id for r in batch]) if self._cancelled_jobs else set()
        results: list[_Done | Exception | None] = [None] * len(batch)
        live: list[tuple[int, TokenizedRequest]] = []
        for i, r in enumerate(batch):
            if r.job_id in gone:
                results[i] = CancelledError("job cancelled before the engine started it")
            elif now >= r.deadline:
                # Expired work never reaches the engine.
                results[i] = ExpiredError("job deadline passed before the engine started it")
            else:
                live.append((i, r))
        if live:
            with self._lock:
                for _, r in live:
                    self._running[r.job_id].add(r.request_id)
            on_tokens = self._publisher.on_tokens if self._publisher is not None else None
            t0 = time.monotonic()
            try:
                outs = run_isolated(
                    lambda reqs: self.engine.generate(reqs, on_tokens),
                    [EngineRequest(r.request_id, r.prompt_token_ids, r.params) for _, r in live],
                    attempts=self._attempts,
                )
            except EngineDeadError as exc:
                log.critical("the engine died running a batch of %d: %s", len(live), exc)
                if self._on_engine_dead is not None:
                    self._on_engine_dead(exc)
                raise
            finally:
                with self._lock:
                    for _, r in live:
                        ids = self._running.get(r.job_id)
                        if ids is not None:
                            ids.discard(r.request_id)
                            if not ids:
                                del self._running[r.job_id]
            dt = time.monotonic() - t0
            for (i, _), out in zip(live, outs, strict=True):
                results[i] = out if isinstance(out, Exception) else _Done(out, len(live), dt)
        return results  # type: ignore[return-value]

    @staticmethod
    def _failed(req: TokenizedRequest, error: StageError) -> Generation:
        finish = {ErrorReason.EXPIRED: FinishReason.EXPIRED, ErrorReason.CANCELLED: FinishReason.CANCELLED}.get(
            error.reason, FinishReason.ERROR)
        return Generation(
            job_id=req.job_id, index=req.index, deadline=req.deadline, enqueued_at=req.enqueued_at,
            prompt_tokens=len(req.prompt_token_ids), finish_reason=finish, error=error,
        )

    def shutdown(self) -> None:
        self.batcher.stop()
