"""Detokenization in the API process for partial and streamed text.

It uses the Rust ``tokenizers`` library on the model's tokenizer.json, so the API still
imports neither torch nor transformers."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from tokenizers import Tokenizer


class Detokenizer:
    """``model_path`` may be a callable, so that resolving the model waits for first use.
    Loading reads a file: call :meth:`tokenizer` off the event loop the first time."""

    def __init__(self, model_path):
        self._model_path = model_path
        self._tok: Tokenizer | None = None
        self._eos: list[int] | None = None
        self._lock = threading.Lock()

    def _path(self) -> str:
        return self._model_path() if callable(self._model_path) else self._model_path

    def eos_ids(self) -> list[int]:
        """The model's EOS ids (generation_config.json, then config.json), as the engines stop at
        them: a streamed output ends at one, without its text (vLLM)."""
        if self._eos is None:
            ids: set[int] = set()
            for name in ("generation_config.json", "config.json"):
                f = Path(self._path()) / name
                value = json.loads(f.read_text()).get("eos_token_id") if f.is_file() else None
                ids.update([value] if isinstance(value, int) else value or [])
            self._eos = sorted(ids)
        return self._eos

    def tokenizer(self) -> Tokenizer:
        if self._tok is None:
            with self._lock:
                if self._tok is None:
                    path = self._path()
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
