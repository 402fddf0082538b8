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
                    self._tok = load_tokenizer(self.model_path)
        return self._tok

    def shutdown(self) -> None:
        self._tok = None


# What AutoTokenizer builds for a tokenizer_config.json naming one of these classes (with a
# tokenizer.json beside it): transformers' fast tokenizer itself, no model-specific subclass.
FAST_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def load_tokenizer(model_path: str) -> Any:
    """The tokenizer AutoTokenizer would load, built without importing torch when it can be.

    AutoTokenizer imports transformers' configuration classes, and through them torch
    (~6 s of a CPU worker's 11 s start here, and so of its restart after a crash), though
    a CPU stage never runs a tensor. A model whose tokenizer_config.json names the
    fast tokenizer (most chat models, both of ours) gets that class straight from its own
    module, which needs no torch; any other class still goes through AutoTokenizer."""
    cfg = Path(model_path) / "tokenizer_config.json"
    try:
        name = json.loads(cfg.read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        name = None
    if name in FAST_TOKENIZER_CLASSES and (Path(model_path) / "tokenizer.json").is_file():
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(model_path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


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
