"""What preprocess checks of the sampling parameters against the model, with vLLM's
messages (vLLM's SamplingParams.verify and update_from_tokenizer, its TokenizeParams):
token ids in the vocabulary, bad words that tokenize, prompt truncation."""

from __future__ import annotations

from typing import Any

from llmpipe.errors import BadRequestError
from llmpipe.messages import SamplingParams

MAX_BAD_WORDS = 128  # vLLM's VLLM_MAX_NUM_BAD_WORDS default


def check_vocab(p: SamplingParams, vocab_size: int) -> None:
    """Token ids the request names must be in the model's vocabulary."""
    for name, ids in (("stop_token_ids", p.stop_token_ids), ("logit_bias", list(p.logit_bias or ()))):
        bad = [t for t in ids if t < 0 or t >= vocab_size]
        if bad:
            raise BadRequestError(f"token_id(s) {bad} in {name} contain out-of-vocab token ids. Vocabulary size: "
                                  f"{vocab_size}", param=name)
    if p.allowed_token_ids is not None:
        if not p.allowed_token_ids:
            raise BadRequestError("allowed_token_ids is not None and empty!", param="allowed_token_ids")
        if any(t < 0 or t >= vocab_size for t in p.allowed_token_ids):
            raise BadRequestError("allowed_token_ids contains out-of-vocab token id!", param="allowed_token_ids")


def bad_words_token_ids(tokenizer: Any, words: list[str], max_token_id: int) -> list[list[int]]:
    """vLLM's update_from_tokenizer: each word as it starts a text and as it follows a space."""
    out: list[list[int]] = []
    for word in words:
        for prefix_space in (False, True):
            ids = tokenizer.encode((" " if prefix_space else "") + word.lstrip(), add_special_tokens=False)
            if not ids:
                if not prefix_space:
                    raise BadRequestError("bad_words entries must tokenize to at least one token.", param="bad_words")
                continue
            if not prefix_space or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(list(ids))
                if len(out) > MAX_BAD_WORDS:
                    raise BadRequestError(f"Too many bad words after tokenization: {len(out)}. The max number is "
                                          f"{MAX_BAD_WORDS}.", param="bad_words")
    bad = [t for ids in out for t in ids if t < 0 or t > max_token_id]
    if bad:
        raise BadRequestError(f"The model vocabulary size is {max_token_id + 1}, but the following tokens were specified "
                              f"as bad: {bad}. All token id values should be integers satisfying: 0 <= token_id <= "
                              f"{max_token_id}.", param="bad_words")
    return out


def keep_tokens(p: SamplingParams, context_len: int) -> int | None:
    """How many prompt tokens truncate_prompt_tokens keeps (-1: the context length less one);
    None: no truncation."""
    n = p.truncate_prompt_tokens
    if n is None:
        return None
    if n > context_len:
        raise BadRequestError(f"truncate_prompt_tokens={n} cannot be greater than max_model_len = {context_len}. "
                              "Please request a smaller truncation size.", param="truncate_prompt_tokens")
    keep = max(0, context_len - 1) if n < 0 else n
    if keep == 0:
        raise BadRequestError("truncate_prompt_tokens=0 leaves no prompt", param="truncate_prompt_tokens")
    return keep


def truncate(ids: list[int], p: SamplingParams, context_len: int) -> list[int]:
    """vLLM's truncation of a token list: the last ``keep`` ids for truncation_side "left"
    (vLLM's default for generation: its tokenizer's side), the first for "right"."""
    keep = keep_tokens(p, context_len)
    if keep is None or keep >= len(ids):
        return ids
    return list(ids[:keep]) if p.truncation_side == "right" else list(ids[-keep:])
