"""Token ids to text exactly as vLLM's OpenAI server makes it, so that llmpipe's answers
match ``vllm serve`` on the same model.

* :class:`IncrementalDetokenizer` is vLLM's (its v1 FastIncrementalDetokenizer, on the Rust
  ``tokenizers`` library): the output decoded after the prompt's last ids (``DecodeStream``),
  with the request's ``skip_special_tokens`` and ``spaces_between_special_tokens``; a
  generation stopped by a token (EOS or a stop id) keeps the token but not its text unless
  ``include_stop_str_in_output``; stop strings are checked once ``min_tokens`` tokens are
  out, the one that completes first wins (ties: list order), the text ends before it (or
  after it, with ``include_stop_str_in_output``) and the ids end at the token that completed
  it; a stream holds back as many characters as the longest stop string, less one.
  Postprocess decodes a whole output with it (:func:`detokenize`), the API decodes a live
  stream with it (api/openai/sse.py), the inference worker decodes the streams it parses
  (llmpipe/parsing/streams.py): the three agree by construction.
* Each logprob token is decoded alone (vLLM's ``convert_ids_list_to_tokens``), with the
  leading space a SentencePiece decode drops put back, and a piece of a character split
  across tokens completed from the tokens sampled before it (vLLM's ``_verify_tokens``).
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from typing import Any

from llmpipe.messages import Detokenizing, Logprob

_REPLACEMENT = "\ufffd"
_INVALID_PREFIX = "Invalid prefix"


@dataclass
class Detokenized:
    text: str
    token_ids: list[int]
    stop_string: str | None = None


def rust_tokenizer(tokenizer: Any) -> Any:
    """The Rust ``tokenizers.Tokenizer`` of a transformers fast tokenizer, or the object itself
    when it is one already (the API's); None for a slow (Python) tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend
    return tokenizer if hasattr(tokenizer, "get_added_tokens_decoder") else None


class _SlowStream:
    """Text deltas of a slow (Python) tokenizer: the decoded prefixes diffed."""

    def __init__(self, tokenizer: Any, prefix: list[int], skip_special_tokens: bool):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prefix)
        self.base = tokenizer.decode(self.ids, skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tok.decode(self.ids, skip_special_tokens=self.skip)
        if text.endswith(_REPLACEMENT):
            return ""
        out, self.base = text[len(self.base):], text
        return out


class IncrementalDetokenizer:
    """vLLM's detokenizer for one output: feed ids with :meth:`update`, read the text with
    :meth:`next_text`. ``prefix``: the prompt's last ids."""

    def __init__(self, tokenizer: Any, prefix: list[int], stop: list[str], opts: Detokenizing | None = None):
        opts = opts or Detokenizing()
        self.opts = opts
        self.stop = [s for s in stop if s]
        self.hold = max(len(s) for s in self.stop) - 1 if self.stop and not opts.include_stop_str_in_output else 0
        self.token_ids: list[int] = []
        self.text = ""
        self.stop_string: str | None = None
        self.sent = 0
        self._rust = rust_tokenizer(tokenizer)
        if self._rust is not None:
            from tokenizers.decoders import DecodeStream

            self._decode_stream = DecodeStream
            self._stream = DecodeStream(ids=list(prefix), skip_special_tokens=opts.skip_special_tokens)
        else:
            self._stream = _SlowStream(tokenizer, prefix, opts.skip_special_tokens)
        self._added: dict[int, str] | None = None
        self._last_special = False
        if not (opts.skip_special_tokens or opts.spaces_between_special_tokens) and self._rust is not None:
            self._added = {i: t.content for i, t in self._rust.get_added_tokens_decoder().items()} or None

    def _step(self, token_id: int) -> str:
        if self._rust is None:
            return self._stream.step(token_id)
        try:
            piece = self._stream.step(self._rust, token_id)
        except Exception as exc:  # tokenizers' "Invalid prefix": restart, as vLLM does
            if not str(exc).startswith(_INVALID_PREFIX):
                raise
            self._stream = self._decode_stream(skip_special_tokens=self.opts.skip_special_tokens)
            piece = self._stream.step(self._rust, token_id)
        if self._added is not None:
            special = self._added.get(token_id)
            if special is not None and self._last_special:
                piece = special  # no space between two special tokens
            self._last_special = special is not None
        return piece or ""

    def update(self, new_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Decode ``new_ids`` (the last of them the stop token when ``stop_terminated``); returns
        the stop string that ended the output, if one did. Ids after the end are ignored."""
        if not new_ids or self.stop_string is not None:
            return None
        skipped = None
        if stop_terminated and not self.opts.include_stop_str_in_output:
            skipped, new_ids = new_ids[-1], new_ids[:-1]
        before, first = len(self.token_ids), len(self.token_ids)
        offsets = [len(self.text)] if self.stop else None
        for t in new_ids:
            self.token_ids.append(t)
            self.text += self._step(t)
            if offsets is not None:
                offsets.append(len(self.text))
        if skipped is not None:
            self.token_ids.append(skipped)
            if offsets is not None:
                offsets.append(len(self.text))
        if offsets is None or len(self.token_ids) <= self.opts.min_tokens:
            return None
        check_from = offsets[max(self.opts.min_tokens - before, 0)]
        found = _find_stop(self.text, len(self.text) - check_from, self.stop, self.opts.include_stop_str_in_output)
        if found is None:
            return None
        self.stop_string, cut = found
        end = len(self.text) if cut == -1 else cut
        if not self.opts.include_stop_str_in_output:
            end += len(self.stop_string)
        del self.token_ids[first + bisect.bisect_left(offsets, end, lo=1):]
        if cut != -1:
            self.text = self.text[:cut]
        return self.stop_string

    def next_text(self, finished: bool = False) -> str:
        """The text not returned yet, less what a stop string may still take back (none once finished)."""
        upto = len(self.text) - (0 if finished or self.stop_string is not None else self.hold)
        if upto <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:upto], upto
        return out


def _find_stop(text: str, new_chars: int, stop: list[str], include: bool) -> tuple[str, int] | None:
    """vLLM's check_stop_strings: (stop string, where to cut the text, -1: nowhere) or None."""
    if not new_chars or not stop:
        return None
    best: tuple[int, int, str] | None = None  # (end, start, stop string)
    for s in stop:
        at = text.find(s, 1 - new_chars - len(s))
        if at != -1 and (best is None or at + len(s) < best[0]):
            best = (at + len(s), at, s)
    if best is None:
        return None
    end, start, s = best
    if include:
        return s, -1 if end >= len(text) else end
    return s, start


def detokenize(tokenizer: Any, ids: list[int], *, prompt_tail: list[int], stop: list[str], stopped_by_token: bool,
               opts: Detokenizing | None = None) -> Detokenized:
    """The output text of ``ids``, as vLLM's detokenizer makes it."""
    d = IncrementalDetokenizer(tokenizer, prompt_tail, stop, opts)
    d.update(list(ids), stop_terminated=stopped_by_token)
    return Detokenized(d.text, list(d.token_ids), d.stop_string)


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
