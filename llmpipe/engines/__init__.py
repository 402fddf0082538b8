"""Inference engines: token ids in, token ids out.

Importing this package is cheap; vLLM, torch and transformers load only when an engine
is built. The interface is ``base`` (re-exported here); ``factory.create_engine`` builds
the engine that the settings name, and ``owner.EngineOwner`` holds one per process.
"""

from __future__ import annotations

from llmpipe.engines.base import Engine, EngineOutput, EngineRequest, TokenCallback

__all__ = ["Engine", "EngineOutput", "EngineRequest", "TokenCallback"]
