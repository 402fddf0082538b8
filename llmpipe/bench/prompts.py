"""Deterministic synthetic prompts of about N tokens, built with the model's tokenizer."""

from __future__ import annotations

from importlib import resources
from typing import Any


def _words() -> list[str]:
    return resources.files("llmpipe.models").joinpath("corpus.txt").read_text().split()


def make_prompts(tokenizer: Any, n: int, tokens: int, seed: int = 0) -> list[str]:
    """``n`` distinct prompts of ~``tokens`` tokens each (as the pipeline tokenizes them).

    Each starts with its own number and a different window of the corpus, so no two share a
    prefix longer than a few tokens (vLLM's prefix cache cannot skip their prefill).
    """
    words = _words()
    special = len(tokenizer("a", add_special_tokens=True)["input_ids"]) - len(tokenizer("a", add_special_tokens=False)["input_ids"])
    want = max(1, tokens - max(0, special))
    out = []
    for i in range(n):
        start = (i * 7919 + seed * 104729) % len(words)
        chunk = []
        j = start
        while len(chunk) < want * 2 + 8:
            chunk.append(words[j % len(words)])
            j += 1
        text = f"Request {seed}-{i}: " + " ".join(chunk)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:want]
        out.append(tokenizer.decode(ids).strip())
    return out


def count_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=True, split_special_tokens=True)["input_ids"])
