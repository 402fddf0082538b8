"""The running slots the batch lane's share is taken of (workers/inference_runtime.py), and
the requests the inference worker holds for them (workers/launch.py)."""

from types import SimpleNamespace

from llmpipe.jobs.lanes import batch_lane_slots
from llmpipe.settings import EngineKind, Settings
from workers.inference_runtime import engine_running_slots
from workers.launch import KINDS, engine_running


def test_the_engines_running_set_where_known_else_the_requests_the_worker_holds():
    s = Settings(max_batch_size=32)
    assert engine_running_slots(SimpleNamespace(max_num_seqs=32), s) == 32  # the SIMULATED GPU
    assert engine_running_slots(SimpleNamespace(max_num_seqs=128), s) == 128  # vLLM's own on a CPU, resolved
    # unknown: the worker never hands the engine more than its threads
    assert engine_running_slots(SimpleNamespace(max_num_seqs=None), s) == 256
    assert engine_running_slots(SimpleNamespace(max_num_seqs=1024), s) == 256
    assert engine_running_slots(object(), s) == 256
    assert batch_lane_slots(0.5, 32) == 16 and batch_lane_slots(0.01, 32) == 1 and batch_lane_slots(1.0, 64) == 64


def test_the_inference_worker_holds_twice_what_the_engine_runs():
    threads = KINDS["inference"].concurrency
    # vLLM: its running set (its CPU default where unset), never less than a dispatch batch
    assert engine_running(Settings()) == 128 and threads(Settings()) == 256
    assert threads(Settings(max_num_seqs=512)) == 1024
    assert threads(Settings(max_num_seqs=8, max_batch_size=32)) == 64
    # every other engine: its dispatch batch
    for kind in (EngineKind.TRANSFORMERS, EngineKind.SIMULATED, EngineKind.NOOP):
        assert engine_running(Settings(engine=kind)) == 32 and threads(Settings(engine=kind)) == 64
    assert threads(Settings(engine=EngineKind.SIMULATED, max_batch_size=1)) == 4
