"""Build the engine that ``Settings.engine`` names. Heavy imports happen only here, lazily."""

from __future__ import annotations

from llmpipe.engines.base import Engine
from llmpipe.errors import EngineError
from llmpipe.settings import EngineKind, Settings


def _model_path(settings: Settings, model_path: str | None) -> str:
    if model_path is not None:
        return model_path
    from llmpipe.models.registry import resolve_model

    return resolve_model(settings.model, settings.models_dir)


def create_engine(settings: Settings, model_path: str | None = None) -> Engine:
    """A new engine for ``settings``; the model is resolved (built, converted) when needed."""
    kind = EngineKind(settings.engine)
    if kind in (EngineKind.VLLM, EngineKind.TRANSFORMERS):
        from llmpipe.engines.platform import engine_config
        from llmpipe.engines.vllm_args import EngineArgError

        try:
            args = engine_config(settings).args
        except EngineArgError as e:
            raise EngineError(str(e)) from None
    if kind is EngineKind.VLLM:
        from llmpipe.engines.vllm_engine import VllmEngine

        return VllmEngine(_model_path(settings, model_path), kv_cache_gib=settings.kv_cache_gib, **args)
    if kind is EngineKind.TRANSFORMERS:
        from llmpipe.engines.hf_engine import TransformersEngine

        return TransformersEngine(_model_path(settings, model_path), **args)
    if kind is EngineKind.NOOP:
        from llmpipe.engines.noop import NoopEngine

        return NoopEngine(max_model_len=settings.max_model_len)
    if kind is EngineKind.SIMULATED:
        from llmpipe.engines.simulated import SimulatedGpuCost, SimulatedGpuEngine

        cost = SimulatedGpuCost(
            prefill_s_per_token=settings.sim_prefill_ms_per_token / 1000.0,
            step_base_s=settings.sim_step_ms / 1000.0,
            step_per_seq_s=settings.sim_step_ms_per_seq / 1000.0,
            max_batch_size=settings.max_batch_size,
        )
        if settings.sim_continuous:
            from llmpipe.engines.simulated import SimulatedContinuousEngine

            return SimulatedContinuousEngine(cost, max_model_len=settings.max_model_len)
        return SimulatedGpuEngine(cost, max_model_len=settings.max_model_len)
    raise ValueError(f"unknown engine {settings.engine!r}")  # pragma: no cover - EngineKind is closed
