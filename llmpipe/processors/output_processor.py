"""Generation -> PromptResult: detokenize and assemble the per-prompt result."""

from __future__ import annotations

import logging
import time
from typing import Any

from llmpipe.messages import ErrorReason, FinishReason, Generation, PromptResult, Stage, StageError, StageTimingSummary
from llmpipe.processors.envelope import WallClock, run_stage

log = logging.getLogger("llmpipe.postprocess")


class OutputProcessor:
    def __init__(self, tokenizer: Any, *, clock: WallClock = time.time):
        self.tokenizer = tokenizer
        self._clock = clock

    def process(self, gen: Generation) -> PromptResult:
        text = ""

        stopped = False

        def detokenize(g: Generation) -> Generation:
            nonlocal text, stopped
            text = self.tokenizer.decode(g.output_token_ids, skip_special_tokens=True)
            text, stopped = apply_stop_strings(text, g.stop)
            return g.model_copy()

        done = run_stage(Stage.POSTPROCESS, gen, detokenize, self._failed, self._clock)
        result = PromptResult(
            index=done.index,
            text=text,
            token_ids=done.output_token_ids if done.error is None else [],
            prompt_tokens=done.prompt_tokens,
            completion_tokens=len(done.output_token_ids) if done.error is None else 0,
            finish_reason=(FinishReason.STOP if stopped else done.finish_reason) if done.error is None else _finish_for(done.error),
            timings={t.stage: StageTimingSummary(queue_wait_s=t.queue_wait_s, run_s=t.run_s) for t in done.timings},
            batch_size=done.batch_size,
            engine_time_s=done.engine_time_s,
            error=done.error,
        )
        self._log(done, result)
        return result

    @staticmethod
    def _failed(gen: Generation, error: StageError) -> Generation:
        return gen.model_copy(update={"error": error})

    def _log(self, gen: Generation, result: PromptResult) -> None:
        elapsed = self._clock() - gen.timings[0].enqueued_at if gen.timings else 0.0
        log.info(
            "job=%s index=%d stage=postprocess elapsed_s=%.4f status=%s finish=%s prompt_tokens=%d completion_tokens=%d batch=%d%s",
            gen.job_id, gen.index, elapsed, "error" if result.error else "ok", result.finish_reason.value,
            result.prompt_tokens, result.completion_tokens, result.batch_size,
            f" error={result.error.reason.value}" if result.error else "",
        )


def apply_stop_strings(text: str, stop: list[str]) -> tuple[str, bool]:
    """Cut ``text`` at the earliest stop string, as the OpenAI API does."""
    cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def _finish_for(error: StageError) -> FinishReason:
    return {ErrorReason.EXPIRED: FinishReason.EXPIRED, ErrorReason.CANCELLED: FinishReason.CANCELLED}.get(
        error.reason, FinishReason.ERROR
    )
