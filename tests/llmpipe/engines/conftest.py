"""Real engines on the tiny model, started once per session (vLLM takes ~10-20 s here). Both
are marked ``@lends``, so that under pytest-xdist their users run in one worker
(tests/harness/distribute.py) and each engine starts once."""

from __future__ import annotations

import pytest

from tests.harness.engine import KV_CACHE_GIB
from tests.harness.shared import lends

IN_PROCESS_ENGINES = ("in-process engines",)

MAX_MODEL_LEN = 1024


@pytest.fixture(scope="session")
@lends(lambda params: IN_PROCESS_ENGINES)
def hf_engine(tiny_model):
    pytest.importorskip("transformers")
    from llmpipe.engines.hf_engine import TransformersEngine

    engine = TransformersEngine(tiny_model, dtype="float32", max_model_len=MAX_MODEL_LEN, max_batch_size=8)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
@lends(lambda params: IN_PROCESS_ENGINES)
def vllm_engine(tiny_model):
    pytest.importorskip("vllm")
    from llmpipe.engines.base import EngineRequest
    from llmpipe.engines.vllm_engine import VllmEngine
    from llmpipe.errors import EngineDeadError
    from llmpipe.messages import SamplingParams

    engine = VllmEngine(
        tiny_model, dtype="float32", max_model_len=MAX_MODEL_LEN, enforce_eager=True, kv_cache_gib=KV_CACHE_GIB, max_num_seqs=8, seed=0
    )
    print(f"\nvLLM engine started in {engine.start_s:.1f}s")
    yield engine
    # Shutting down is idempotent, and an engine that is shut down refuses work.
    engine.shutdown()
    engine.shutdown()
    with pytest.raises(EngineDeadError):
        engine.generate([EngineRequest("after", [5, 6], SamplingParams(max_tokens=2, temperature=0))])
