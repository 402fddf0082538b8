"""Detokenization in the API process for partial and streamed text.

It uses the Rust ``tokenizers`` library on the model's tokenizer.json, so the API still
imports neither torch nor transformers."""

from __future__ import annotations

import threading
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class Detokenizer:
    """``model_path`` may be a callable, so that resolving the model waits for first use.
    Loading reads a file: call :meth:`tokenizer` off the event loop the first time."""

    def __init__(self, model_path):
        self._model_path = model_path
        self._tok: Tokenizer | None = None
        self._lock = threading.Lock()

    def tokenizer(self) -> Tokenizer:
        if self._tok is None:
            with self._lock:
                if self._tok is None:
                    path = self._model_path() if callable(self._model_path) else self._model_path
                    f = Path(path) / "tokenizer.json"
                    self._tok = Tokenizer.from_file(str(f)) if f.is_file() else Tokenizer.from_pretrained(path)
        return self._tok

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer().decode(ids, skip_special_tokens=True)


class IncrementalText:
    """Text deltas from a growing list of token ids, in O(1) per token: the library's own
    streaming decoder (``DecodeStream``) keeps only the last few ids it needs. A token
    that ends inside a UTF-8 sequence gives no text until the next one completes it; what
    is still held at the end comes with the final text (``_Choice.rest`` in api/sse.py)."""

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)

    def push(self, new_ids: list[int]) -> str:
        out = []
        for i in new_ids:
            piece = self._stream.step(self._tok, i)
            if piece:
                out.append(piece)
        return "".join(out)
