"""The transformers engine's next-token choice, with vLLM's sampling semantics.

Per request, on one row of logits (float32), in the order of vLLM's v1 sampler:
``allowed_token_ids`` (every other token masked), ``bad_words`` (the last token of a
forbidden sequence whose prefix the output ends with), ``min_tokens`` (the stop ids and EOS
masked until that many tokens are out), ``logit_bias``, then the penalties: repetition
(over prompt and output tokens: a positive logit divided by it, a negative one multiplied),
frequency and presence (over the output, OpenAI's definition). Temperature 0 takes the
argmax of the result; otherwise the logits are divided by the temperature and ``min_p``,
``top_k`` and ``top_p`` cut the distribution before a draw from the request's generator.

Log probabilities stay vLLM's default: the raw model's, before any of this (hf_engine.py).
"""

from __future__ import annotations

from typing import Any

from llmpipe.messages import SamplingParams


def needs_processing(p: SamplingParams) -> bool:
    return bool(p.allowed_token_ids or p.bad_words_token_ids or p.min_tokens or p.logit_bias
                or p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty)


def process(torch: Any, row: Any, p: SamplingParams, prompt: list[int], out: list[int], stops: set[int]) -> Any:
    """``row`` processed in place (one request's logits), as vLLM's logits processors and penalties."""
    vocab = row.shape[-1]
    if p.allowed_token_ids:
        keep = torch.zeros(vocab, dtype=torch.bool, device=row.device)
        keep[[t for t in p.allowed_token_ids if t < vocab]] = True
        row.masked_fill_(~keep, float("-inf"))
    for word in p.bad_words_token_ids or ():
        if len(word) <= len(out) + 1 and (len(word) == 1 or out[-(len(word) - 1):] == word[:-1]):
            row[word[-1]] = float("-inf")
    if len(out) < p.min_tokens and stops:
        row[[t for t in stops if t < vocab]] = float("-inf")
    for t, bias in (p.logit_bias or {}).items():
        if 0 <= t < vocab:
            row[t] += bias
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({t for t in (*prompt, *out) if t < vocab}), dtype=torch.long, device=row.device)
        if seen.numel():
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and out:
        counts = torch.bincount(torch.tensor(out, dtype=torch.long, device=row.device), minlength=vocab)[:vocab]
        row -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty * (counts > 0).to(row.dtype)
    return row


def draw(torch: Any, row: Any, p: SamplingParams, generator: Any) -> int:
    """A token from ``row`` (processed logits) at the request's temperature, min_p, top_k and top_p."""
    probs = torch.softmax(row / p.temperature, dim=-1)
    if p.min_p > 0:
        probs = torch.where(probs < p.min_p * probs.max(), torch.zeros_like(probs), probs)
    if p.top_k > 0 and p.top_k < probs.numel():
        kth = probs.topk(p.top_k).values[-1]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    if p.top_p < 1.0:
        sorted_probs, idx = probs.sort(descending=True)
        sorted_probs = sorted_probs / sorted_probs.sum()
        cum = sorted_probs.cumsum(-1)
        sorted_probs[(cum - sorted_probs) > p.top_p] = 0.0  # keep the smallest set reaching top_p
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator).item())
