"""Inference engines: token ids in, token ids out.

Importing this package is cheap; vLLM, torch and transformers load only when an engine
is built (``create_engine`` or the engine modules themselves).
"""

from __future__ import annotations

from llmpipe.engines.base import Engine, EngineOutput, EngineRequest, TokenCallback
from llmpipe.engines.factory import create_engine
from llmpipe.engines.owner import EngineOwner

__all__ = ["Engine", "EngineOutput", "EngineOwner", "EngineRequest", "TokenCallback", "create_engine"]
