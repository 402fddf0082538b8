"""Build the engine that ``Settings.engine`` names. The engine modules are cheap to import:
each imports its heavy library (vLLM, torch, transformers) only when an engine is built."""

from __future__ import annotations

from llmpipe.engines import hf_engine, noop, simulated, vllm_engine
from llmpipe.engines.base import Engine
from llmpipe.engines.platform import engine_config
from llmpipe.engines.vllm_args import EngineArgError
from llmpipe.errors import EngineError
from llmpipe.models import registry
from llmpipe.settings import EngineKind, Settings


def _model_path(settings: Settings, model_path: str | None) -> str:
    if model_path is not None:
        return model_path
    return registry.resolve_model(settings.model, settings.models_dir)


def _simulated(settings: Settings) -> Engine:
    cost = simulated.SimulatedGpuCost(
        prefill_s_per_token=settings.sim_prefill_ms_per_token / 1000.0,
        step_base_s=settings.sim_step_ms / 1000.0,
        step_per_seq_s=settings.sim_step_ms_per_seq / 1000.0,
        max_batch_size=settings.max_batch_size,
    )
    if settings.sim_continuous:
        return simulated.SimulatedContinuousEngine(cost, max_model_len=settings.max_model_len)
    return simulated.SimulatedGpuEngine(cost, max_model_len=settings.max_model_len)


def create_engine(settings: Settings, model_path: str | None = None, model: str | None = None) -> Engine:
    """A new engine for ``settings``; the model is resolved (built, converted) when needed.
    ``model``: the served model's name (None: the default), whose reasoning parser vLLM's
    structured outputs wait for (vllm serve's --reasoning-parser)."""
    kind = EngineKind(settings.engine)
    if kind in (EngineKind.VLLM, EngineKind.TRANSFORMERS):
        try:
            args = engine_config(settings).args
        except EngineArgError as e:
            raise EngineError(str(e)) from None
    if kind is EngineKind.VLLM:
        reasoning = settings.parsers(model).reasoning_parser
        own = {"reasoning_parser": reasoning} if reasoning else {}
        return vllm_engine.VllmEngine(_model_path(settings, model_path), kv_cache_gib=settings.kv_cache_gib, **own, **args)
    if kind is EngineKind.TRANSFORMERS:
        return hf_engine.TransformersEngine(_model_path(settings, model_path), **args)
    if kind is EngineKind.NOOP:
        return noop.NoopEngine(max_model_len=settings.max_model_len)
    if kind is EngineKind.SIMULATED:
        return _simulated(settings)
    raise ValueError(f"unknown engine {settings.engine!r}")  # pragma: no cover - EngineKind is closed
