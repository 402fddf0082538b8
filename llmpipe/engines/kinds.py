"""The engine class of each engine kind, for what an engine declares it can do
(llmpipe/engines/base.py refusal): the API checks a request against it before enqueuing,
without building an engine. The engine modules import their heavy libraries only when an
engine is built."""

from __future__ import annotations

from llmpipe.engines import hf_engine, noop, simulated, vllm_engine
from llmpipe.engines.base import Engine
from llmpipe.settings import EngineKind


def engine_class(kind: EngineKind | str, continuous: bool = False) -> type[Engine]:
    kind = EngineKind(kind)
    if kind is EngineKind.VLLM:
        return vllm_engine.VllmEngine
    if kind is EngineKind.TRANSFORMERS:
        return hf_engine.TransformersEngine
    if kind is EngineKind.NOOP:
        return noop.NoopEngine
    return simulated.SimulatedContinuousEngine if continuous else simulated.SimulatedGpuEngine
