"""The model's own tokenizer, loaded once per process."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any


class TokenizerOwner:
    """Lazily loads the tokenizer on first use; one per worker process."""

    def __init__(self, model_path: str):
        self.model_path = model_path
        self._tok: Any = None
        self._lock = threading.Lock()

    def get(self) -> Any:
        if self._tok is None:
            with self._lock:
                if self._tok is None:
                    from transformers import AutoTokenizer

                    self._tok = AutoTokenizer.from_pretrained(self.model_path)
        return self._tok

    def shutdown(self) -> None:
        self._tok = None


def model_vocab_size(model_path: str) -> int | None:
    """vocab_size from a local model's config.json (or its text_config), if it is there."""
    cfg = Path(model_path) / "config.json"
    if not cfg.is_file():
        return None
    data = json.loads(cfg.read_text())
    for d in (data, data.get("text_config") or {}):
        if isinstance(d.get("vocab_size"), int):
            return d["vocab_size"]
    return None


def model_context_length(model_path: str) -> int | None:
    """max_position_embeddings from a local model's config.json, if it is there."""
    cfg = Path(model_path) / "config.json"
    if not cfg.is_file():
        return None
    data = json.loads(cfg.read_text())
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        if isinstance(data.get(key), int):
            return data[key]
    return None
