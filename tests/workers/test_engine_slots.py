"""The running slots the batch lane's share is taken of (workers/inference_runtime.py)."""

from types import SimpleNamespace

from llmpipe.jobs.lanes import batch_lane_slots
from llmpipe.settings import Settings
from workers.inference_runtime import engine_running_slots


def test_the_engines_running_set_where_known_else_the_requests_the_worker_holds():
    s = Settings(max_batch_size=32)
    assert engine_running_slots(SimpleNamespace(max_num_seqs=32), s) == 32  # vLLM on the CPU, the SIMULATED GPU
    # vLLM's own default (None here; 256 and more on a GPU): the worker never hands it more
    # than its threads, 2 x max_batch_size
    assert engine_running_slots(SimpleNamespace(max_num_seqs=None), s) == 64
    assert engine_running_slots(SimpleNamespace(max_num_seqs=1024), s) == 64
    assert engine_running_slots(object(), s) == 64
    assert batch_lane_slots(0.5, 32) == 16 and batch_lane_slots(0.01, 32) == 1 and batch_lane_slots(1.0, 64) == 64
