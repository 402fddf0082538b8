from __future__ import annotations

import pytest

from llmpipe.engines.factory import create_engine
from llmpipe.engines.noop import NoopEngine
from llmpipe.engines.simulated import SimulatedGpuEngine
from llmpipe.settings import EngineKind, Settings


def test_noop_and_simulated_need_no_model(monkeypatch):
    import llmpipe.models.registry as registry

    monkeypatch.setattr(registry, "resolve_model", lambda *a, **k: pytest.fail("resolved a model"))
    assert isinstance(create_engine(Settings(engine=EngineKind.NOOP)), NoopEngine)
    sim = create_engine(Settings(engine=EngineKind.SIMULATED, max_batch_size=7))
    assert isinstance(sim, SimulatedGpuEngine) and sim.cost.max_batch_size == 7


@pytest.mark.parametrize(("kind", "module", "cls"), [
    (EngineKind.VLLM, "llmpipe.engines.vllm_engine", "VllmEngine"),
    (EngineKind.TRANSFORMERS, "llmpipe.engines.hf_engine", "TransformersEngine"),
])
def test_real_engines_get_the_resolved_model(monkeypatch, tmp_path, kind, module, cls):
    import importlib

    import llmpipe.models.registry as registry

    seen = {}

    def fake_engine(model, **kwargs):
        seen["model"], seen["kwargs"] = model, kwargs
        return NoopEngine()

    monkeypatch.setattr(importlib.import_module(module), cls, fake_engine)
    monkeypatch.setattr(registry, "resolve_model", lambda name, models_dir, progress=False: f"/resolved/{name}")
    settings = Settings(engine=kind, model="tiny", dtype="float32", max_batch_size=5, state_dir=tmp_path)
    create_engine(settings)
    assert seen["model"] == "/resolved/tiny"
    assert seen["kwargs"]["dtype"] == "float32"
    create_engine(settings, model_path="/given")
    assert seen["model"] == "/given"
