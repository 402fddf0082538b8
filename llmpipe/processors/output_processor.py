"""Generation -> PromptResult: detokenize (with the request's detokenizing options), parse a
chat output with the model's parsers (vLLM's tool-call and reasoning parsers,
llmpipe/parsing/vllm_parsers.py), and assemble the per-prompt result."""

from __future__ import annotations

import logging
import time
from typing import Any

from llmpipe.messages import ErrorReason, FinishReason, Generation, PromptResult, Stage, StageError, StageTimingSummary
from llmpipe.processors.detokenize import Detokenized, detokenize, name_logprobs
from llmpipe.processors.envelope import WallClock, run_stage

log = logging.getLogger("llmpipe.postprocess")


class OutputProcessor:
    """``parser``: the model's ModelParser when the model has parsers (None: outputs stay text)."""

    def __init__(self, tokenizer: Any, *, clock: WallClock = time.time, parser: Any = None):
        self.tokenizer = tokenizer
        self.parser = parser
        self._clock = clock

    def process(self, gen: Generation) -> PromptResult:
        out: dict[str, Any] = {}

        def shape(g: Generation) -> Generation:
            # Text, stop strings and logprob token texts exactly as vLLM's server makes them
            # (llmpipe/processors/detokenize.py).
            d: Detokenized = detokenize(self.tokenizer, g.output_token_ids, prompt_tail=g.prompt_tail, stop=g.stop,
                                        stopped_by_token=g.finish_reason == FinishReason.STOP, opts=g.detok)
            out["detok"] = d
            if g.parsing is not None and self.parser is not None:
                out["parsed"] = self.parser.parse(g.parsing, d.text, d.token_ids, stopped=g.finish_reason == FinishReason.STOP
                                                  or d.stop_string is not None)
            if g.logprobs is not None:
                out["logprobs"] = name_logprobs(self.tokenizer, g.logprobs[: len(d.token_ids)])
            if g.prompt_logprobs is not None:
                out["prompt_logprobs"] = name_logprobs(self.tokenizer, g.prompt_logprobs, prompt=True)
            if g.prompt_token_ids is not None:
                out["prompt_text"] = self.tokenizer.decode(g.prompt_token_ids)
            return g.model_copy()

        done = run_stage(Stage.POSTPROCESS, gen, shape, self._failed, self._clock)
        ok = done.error is None
        d: Detokenized = out.get("detok") or Detokenized("", [])
        finish = (FinishReason.STOP if d.stop_string is not None else done.finish_reason) if ok else _finish_for(done.error)
        parsed = out.get("parsed")
        result = PromptResult(
            index=done.index,
            text=d.text,
            token_ids=d.token_ids,
            prompt_tokens=done.prompt_tokens,
            completion_tokens=len(d.token_ids),
            finish_reason=finish,
            timings={t.stage: StageTimingSummary(queue_wait_s=t.queue_wait_s, run_s=t.run_s) for t in done.timings},
            batch_size=done.batch_size,
            engine_time_s=done.engine_time_s,
            first_token_at=done.first_token_at,
            error=done.error,
            stop_reason=d.stop_string if d.stop_string is not None else done.stop_token if ok else None,
            prompt_token_ids=done.prompt_token_ids if ok else None,
            prompt_text=out.get("prompt_text"),
            logprobs=out.get("logprobs"),
            prompt_logprobs=out.get("prompt_logprobs"),
            parsed=parsed,
        )
        self._log(done, result)
        return result

    @staticmethod
    def _failed(gen: Generation, error: StageError) -> Generation:
        return gen.model_copy(update={"error": error})

    def _log(self, gen: Generation, result: PromptResult) -> None:
        # Per prompt at DEBUG; the job's one INFO line is written when it is collected.
        if not log.isEnabledFor(logging.DEBUG):
            return
        elapsed = self._clock() - gen.timings[0].enqueued_at if gen.timings else 0.0
        log.debug(
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
