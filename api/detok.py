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

    def decode_with_special(self, ids: list[int]) -> str:
        """Special tokens kept, as vLLM's ``/detokenize`` answers."""
        return self.tokenizer().decode(ids, skip_special_tokens=False)


class Detokenizers:
    """One Detokenizer per served model (llmpipe/models/served.py), each loaded on first use."""

    def __init__(self, served, model_path):
        """``model_path(source)``: the folder of a model's source (resolved when first needed)."""
        self.served = served
        self._by_name = {m.name: Detokenizer(lambda src=m.source: model_path(src)) for m in served.models}

    def get(self, model: str | None = None) -> Detokenizer:
        """The model's (None: the default); a name not served raises ModelNotFoundError."""
        return self._by_name[self.served.get(model).name]


class IncrementalText:
    """Text deltas from a growing list of token ids, in O(1) per token: the library's own
    streaming decoder (``DecodeStream``) keeps only the last few ids it needs. A token
    that ends inside a UTF-8 sequence gives no text until the next one completes it; what
    is still held at the end comes with the final text (``_Choice.rest`` in api/openai/sse.py).

    ``prefix``: the prompt's last ids, which postprocess decodes the output after
    (llmpipe/processors/detokenize.py, as vLLM): the streamed text then is the final text's
    own beginning, a first token's leading space included. ``stop_ids``: ids that end the
    output without text of their own (vLLM drops a stop token's text), never decoded."""

    def __init__(self, tokenizer: Tokenizer, prefix: list[int] | None = None, stop_ids: set[int] | frozenset = frozenset()):
        self._tok = tokenizer
        self._stop_ids = stop_ids
        self._stream = DecodeStream(ids=list(prefix or []), skip_special_tokens=True)

    def push(self, new_ids: list[int]) -> str:
        out = []
        for i in new_ids:
            if i in self._stop_ids:
                continue
            try:
                piece = self._stream.step(self._tok, i)
            except Exception as exc:  # tokenizers' "Invalid prefix": restart, as vLLM (and postprocess) do
                if not str(exc).startswith("Invalid prefix"):
                    raise
                self._stream = DecodeStream(skip_special_tokens=True)
                piece = self._stream.step(self._tok, i)
            if piece:
                out.append(piece)
        return "".join(out)
