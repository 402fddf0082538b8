"""Detokenization in the API process for partial and streamed text.

It uses the Rust ``tokenizers`` library on the model's tokenizer.json, so the API still
imports neither torch nor transformers."""

from __future__ import annotations

import threading
from pathlib import Path

from tokenizers import Tokenizer


class Detokenizer:
    """``model_path`` may be a callable, so that resolving the model waits for first use."""

    def __init__(self, model_path):
        self._model_path = model_path
        self._tok: Tokenizer | None = None
        self._lock = threading.Lock()

    def _get(self) -> Tokenizer:
        if self._tok is None:
            with self._lock:
                if self._tok is None:
                    path = self._model_path() if callable(self._model_path) else self._model_path
                    f = Path(path) / "tokenizer.json"
                    self._tok = Tokenizer.from_file(str(f)) if f.is_file() else Tokenizer.from_pretrained(path)
        return self._tok

    def decode(self, ids: list[int]) -> str:
        return self._get().decode(ids, skip_special_tokens=True)

    def decode_with_special(self, ids: list[int]) -> str:
        """Special tokens kept, as vLLM's ``/detokenize`` answers."""
        return self._get().decode(ids, skip_special_tokens=False)


class IncrementalText:
    """Text deltas from a growing list of token ids. A trailing partial UTF-8 sequence
    decodes to U+FFFD; it is held back until the next token completes it."""

    def __init__(self, detok: Detokenizer):
        self.detok = detok
        self.ids: list[int] = []
        self.sent = ""

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        text = self.detok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        if not text.startswith(self.sent):  # a merge changed earlier text; send nothing stale
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta
