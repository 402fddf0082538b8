"""The body of the inference task (tasks/inference.py), without Celery: a TokenizedRequest
in, its Generation out (as JSON), idempotent by request id, with a dead letter for a
request that failed for good."""

from __future__ import annotations

from collections.abc import Callable

from llmpipe.jobs.deadletter import DeadLetters
from llmpipe.jobs.memo import DELIVERY, StageMemo
from llmpipe.messages import ErrorReason, Stage, StageError, TokenizedRequest
from llmpipe.observability import metrics
from llmpipe.processors.envelope import as_json
from llmpipe.processors.inference_processor import InferenceProcessor

_STAGE = Stage.INFERENCE.value


class InferenceStage:
    """``processor`` gives the process's InferenceProcessor (engine and batcher), built on
    first use; ``model``: the served model this process's engine runs (the metrics label)."""

    def __init__(self, memo: StageMemo, processor: Callable[[], InferenceProcessor], deadletters: DeadLetters, *,
                 model: str, max_deliveries: int):
        self.memo = memo
        self.processor = processor
        self.deadletters = deadletters
        self.model = model
        self.max_deliveries = max_deliveries

    def run(self, msg: dict) -> dict:
        # On a threads pool each thread waits here while the process's one batcher runs its
        # request with others through the engine.
        req = TokenizedRequest.model_validate(msg)
        if req.error is not None:
            return self._infer(req)
        # Idempotent by request id: a redelivered or duplicated message returns the result
        # stored by the first run instead of running the engine again (llmpipe/jobs/memo.py).
        value, _ = self.memo.run(_STAGE, req.request_id, req.deadline, lambda: self._infer(req),
                                 over_limit=lambda n: self._over_limit(req, n))
        return value

    def _infer(self, req: TokenizedRequest) -> dict:
        # A redelivered message (its worker died) continues from the tokens its first delivery
        # streamed, so a client never sees text that the result then contradicts.
        out = self.processor().process(req, resume=DELIVERY.get() > 1)
        metrics.observe_stage(out.timings[-1], self.model)
        if out.error is not None and req.error is None:
            metrics.observe_error(out.error.reason.value, _STAGE)
            if out.error.reason == ErrorReason.ENGINE_ERROR:  # failed for good, after isolation and retries
                self.deadletters.record(stage=_STAGE, reason=out.error.reason.value, message=out.error.message,
                                        job_id=req.job_id, request_id=req.request_id,
                                        prompt_tokens=len(req.prompt_token_ids))
        return as_json(out)

    def _over_limit(self, req: TokenizedRequest, deliveries: int) -> dict:
        """A request whose worker died on each of its deliveries (it kills the engine): stop."""
        message = (f"the request was delivered {deliveries} times and its worker was lost each time "
                   f"(max_deliveries={self.max_deliveries}); it was not run again")
        self.deadletters.record(stage=_STAGE, reason="max_deliveries", message=message, job_id=req.job_id,
                                request_id=req.request_id, deliveries=deliveries)
        err = StageError(reason=ErrorReason.ENGINE_ERROR, message=message, stage=Stage.INFERENCE)
        return as_json(InferenceProcessor.failed(req, err).model_copy(update={"timings": req.timings}))
