"""Between llmpipe's messages and vLLM's types: sampling parameters in, logprobs, finish
reasons and scheduler stats out, and which vLLM errors are worth a retry. vLLM is imported
only inside the functions that need it (llmpipe/engines/vllm_engine.py runs them in the
worker).

The detokenizing options (skip_special_tokens, spaces_between_special_tokens,
include_stop_str_in_output) and stop strings are not vLLM's business here: it returns ids,
and postprocess (and the API's live decode) make the text with them. min_tokens is both:
vLLM holds back the stop ids and EOS, the detokenizer the stop strings."""

from __future__ import annotations

from typing import Any

from llmpipe.messages import FinishReason, Logprob, SamplingParams

_TRANSIENT_MARKERS = ("out of memory", "outofmemory", "queueoverflow", "maxqueuedtokens", "no available memory")


def as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def is_transient(exc: BaseException) -> bool:
    """An out-of-memory or a full queue, anywhere in the chain of causes: worth a retry."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = f"{type(e).__name__} {e}".lower()
        if any(marker in text for marker in _TRANSIENT_MARKERS):
            return True
        e = e.__cause__ or e.__context__
    return False


class StatsSink:
    """A vLLM per-engine stat logger that keeps the latest scheduler stats and adds up the
    prefix cache's: prompt tokens looked up and found (vLLM's prefix_cache_queries / hits)."""

    def __init__(self) -> None:
        self.latest: Any = None
        self.prefix_queries = 0
        self.prefix_hits = 0

    def factory(self, vllm_config: Any, engine_index: int = 0) -> Any:
        from vllm.v1.metrics.loggers import StatLoggerBase

        sink = self

        class _Logger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
                if scheduler_stats is not None:
                    sink.latest = scheduler_stats
                    pc = getattr(scheduler_stats, "prefix_cache_stats", None)
                    if pc is not None:
                        sink.prefix_queries += int(pc.queries)
                        sink.prefix_hits += int(pc.hits)

            def log_engine_initialized(self) -> None:
                pass

        return _Logger(vllm_config, engine_index)


def position(entries: Any) -> list[Logprob]:
    """vLLM's logprobs of one position ({token id: Logprob}, the sampled token first) as ours.
    -inf becomes -9999.0, as vLLM's server writes it, so that the JSON stays valid."""
    return [Logprob(id=int(t), logprob=max(float(lp.logprob), -9999.0), rank=lp.rank) for t, lp in entries.items()]


def prompt_positions(prompt_ids: list[int], plp: Any) -> list[list[Logprob]]:
    """vLLM's prompt logprobs (None for the first token, which nothing precedes)."""
    return [[Logprob(id=prompt_ids[0])] if pos is None else position(pos) for pos in plp]


def sampling_params(p: SamplingParams, eos_ids: list[int]) -> Any:
    """Ours as vLLM's: ids out (``detokenize=False``), stop strings and the detokenizing
    options left to postprocess, the model's EOS ids added to the stop ids unless
    ``ignore_eos``, deltas streamed. Built with vLLM's ``from_optional``, as its server builds
    them, so that vLLM's own checks run on every value."""
    from vllm import SamplingParams as VSamplingParams
    from vllm.sampling_params import RequestOutputKind

    from llmpipe.parsing.vllm_parsers import to_vllm_structured

    stop = list(dict.fromkeys(list(p.stop_token_ids) + ([] if p.ignore_eos else eos_ids)))
    return VSamplingParams.from_optional(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        seed=p.seed,
        stop_token_ids=stop,
        ignore_eos=p.ignore_eos,
        min_tokens=p.min_tokens,
        logit_bias=p.logit_bias,
        allowed_token_ids=p.allowed_token_ids,
        bad_words=list(p.bad_words) or None,
        logprobs=p.logprobs,
        prompt_logprobs=p.prompt_logprobs,
        structured_outputs=to_vllm_structured(p.structured),
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
    )


# vLLM's finish reasons; none (the stream ended without one): cancelled if it was, else length.
FINISH = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.CANCELLED,
    "repetition": FinishReason.STOP,
}


def stop_token(stop_reason: Any) -> int | None:
    """vLLM's stop_reason is the stop token id, a stop string, or None for the tokenizer's EOS."""
    return stop_reason if isinstance(stop_reason, int) and not isinstance(stop_reason, bool) else None
