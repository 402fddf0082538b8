"""Token ids to text exactly as vLLM's OpenAI server makes it, so that llmpipe's answers
match ``vllm serve`` on the same model.

* The output text is decoded incrementally after the prompt's last ids (tokenizers'
  ``DecodeStream``, as vLLM's FastIncrementalDetokenizer), skipping special tokens.
* A generation stopped by a token (EOS or a stop id) keeps the token but not its text.
* Stop strings are checked after each token; the one that completes first wins (ties: list
  order); the text ends before it and the ids end at the token that completed it.
* Each logprob token is decoded alone (vLLM's ``convert_ids_list_to_tokens``), with the
  leading space a SentencePiece decode drops put back, and a piece of a character split
  across tokens completed from the tokens sampled before it (vLLM's ``_verify_tokens``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from llmpipe.messages import Logprob

_REPLACEMENT = "\ufffd"


@dataclass
class Detokenized:
    text: str
    token_ids: list[int]
    stop_string: str | None = None


class _Stream:
    """Text deltas, one token at a time, after ``prefix`` ids."""

    def __init__(self, tokenizer: Any, prefix: list[int]):
        self.tok = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self.backend = backend
            self.stream = DecodeStream(ids=list(prefix), skip_special_tokens=True)
        else:  # a slow (Python) tokenizer: diff the decoded prefixes
            self.backend = None
            self.ids = list(prefix)
            self.base = tokenizer.decode(self.ids, skip_special_tokens=True)
            self.prefix_len = len(self.base)

    def step(self, token_id: int) -> str:
        if self.backend is not None:
            try:
                return self.stream.step(self.backend, token_id) or ""
            except Exception as exc:  # tokenizers' "Invalid prefix": restart, as vLLM does
                if not str(exc).startswith("Invalid prefix"):
                    raise
                from tokenizers.decoders import DecodeStream

                self.stream = DecodeStream(skip_special_tokens=True)
                return self.stream.step(self.backend, token_id) or ""
        self.ids.append(token_id)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.endswith(_REPLACEMENT):
            return ""
        out, self.base = text[len(self.base):], text
        return out


def detokenize(tokenizer: Any, ids: list[int], *, prompt_tail: list[int], stop: list[str],
               stopped_by_token: bool) -> Detokenized:
    """The output text of ``ids``, cut at the first stop string as vLLM's detokenizer does."""
    stream = _Stream(tokenizer, prompt_tail)
    stops = [s for s in stop if s]
    text = ""
    n_text = len(ids) - 1 if stopped_by_token and ids else len(ids)
    for k, token_id in enumerate(ids[:n_text], start=1):
        new = stream.step(token_id)
        text += new
        if not new or not stops:
            continue
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for s in stops:
            at = text.find(s, max(0, len(text) - len(new) - len(s) + 1))
            if at >= 0 and (best is None or at + len(s) < best[0]):
                best = (at + len(s), at, s)
        if best is not None:
            return Detokenized(text[: best[1]], list(ids[:k]), best[2])
    return Detokenized(text, list(ids))


def _space_marker(tokenizer: Any) -> str | None:
    """The Metaspace replacement character ("▁") whose leading copy decode() drops, if any."""
    cached = getattr(tokenizer, "_llmpipe_space_marker", False)
    if cached is not False:
        return cached
    marker = None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        try:
            pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
        except Exception:
            pre = {}
        for p in [pre, *pre.get("pretokenizers", [])]:
            if p.get("type") == "Metaspace":
                marker = p.get("replacement", "\u2581")
                break
    try:
        tokenizer._llmpipe_space_marker = marker
    except Exception:  # pragma: no cover - a tokenizer that refuses attributes
        pass
    return marker


def token_strings(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each id decoded alone (special tokens kept), as vLLM's convert_ids_list_to_tokens."""
    if not ids:
        return []
    texts = [t or "" for t in tokenizer.batch_decode([[i] for i in ids])]
    marker = _space_marker(tokenizer)
    if marker is None:
        return texts
    out = []
    for raw, text in zip(tokenizer.convert_ids_to_tokens(ids), texts, strict=True):
        lead = len(raw or "") - len((raw or "").lstrip(marker))
        missing = lead - (len(text) - len(text.lstrip(" ")))
        out.append(" " * missing + text if missing > 0 else text)
    return out


def _complete_split_char(tokenizer: Any, token_id: int, context: list[int]) -> str:
    """A token that decodes to part of a character, completed from the tokens before it
    (vLLM's LogprobsProcessor._correct_decoded_token)."""
    for n in range(1, min(len(context), 4) + 1):
        ctx = context[-n:]
        full = tokenizer.decode(ctx + [token_id])
        if full.endswith(_REPLACEMENT):
            continue
        clean_end = len(ctx)
        for j in range(len(ctx) - 1, -1, -1):
            if tokenizer.decode([ctx[j]]).endswith(_REPLACEMENT):
                clean_end = j
            else:
                break
        prefix = tokenizer.decode(ctx[:clean_end]) if clean_end > 0 else ""
        if full.startswith(prefix):
            return full[len(prefix):]
        common = 0
        for a, b in zip(prefix, full):
            if a != b:
                break
            common += 1
        return full[common:]
    return ""


def name_logprobs(tokenizer: Any, positions: list[list[Logprob]], *, prompt: bool = False) -> list[list[Logprob]]:
    """``positions`` with each entry's ``token`` text filled in. For prompt logprobs, the
    first position (no logprob) is decoded plainly and is no context for the rest, as in vLLM."""
    flat = [e.id for pos in positions for e in pos]
    texts = iter(token_strings(tokenizer, flat))
    out: list[list[Logprob]] = []
    context: list[int] = []
    for i, pos in enumerate(positions):
        named = [e.model_copy(update={"token": next(texts)}) for e in pos]
        if prompt and i == 0 and pos and pos[0].logprob is None:
            named = [e.model_copy(update={"token": tokenizer.decode([e.id])}) for e in pos]
            out.append(named)
            continue
        for j, e in enumerate(named):
            if e.token.endswith(_REPLACEMENT):
                named[j] = e.model_copy(update={"token": _complete_split_char(tokenizer, e.id, context[-4:])})
        if pos:
            context.append(pos[0].id)
        out.append(named)
    return out
