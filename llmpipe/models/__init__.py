"""Local model folders for llmpipe: the tiny test model, SmolLM2 from its wheel, resolution.

Importing this package is cheap; torch and transformers are imported only when building.
"""

from __future__ import annotations

from llmpipe.models.errors import ModelPreparationError
from llmpipe.models.registry import context_length, resolve_model
from llmpipe.models.smollm2 import prepare_smollm2
from llmpipe.models.tiny import build_tiny

__all__ = [
    "ModelPreparationError",
    "build_tiny",
    "context_length",
    "prepare_smollm2",
    "resolve_model",
]
