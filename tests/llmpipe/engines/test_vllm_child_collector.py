"""A process that vLLM spawns (its engine core, its executor workers) imports vLLM with the
garbage collector off (llmpipe/engines/vllm_core_guard.py): the guard's module, which the
child imports first as it unpickles its start function, pauses the collector, and the start
functions turn it back on. Once a start function ends, the heap is frozen, so that the
interpreter's exit does not sweep it. Real spawned processes, no vLLM."""

from __future__ import annotations

import gc
import multiprocessing
import os
import sys
import types
from pathlib import Path

import pytest

from llmpipe.engines import vllm_core_guard


def write_collector_state(path: str) -> None:
    """Run by the child while it unpickles its arguments, which it does after unpickling its
    start function: writes whether the collector is on then, and ends the child there (the
    start function never runs)."""
    Path(path).write_text(str(gc.isenabled()))
    os._exit(0)


class CollectorProbe:
    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return write_collector_state, (self.path,)


def _collector_while_unpickling(tmp_path: Path, name: str) -> str:
    out = tmp_path / f"{name}.txt"
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(name=name, target=vllm_core_guard.worker_main, args=(CollectorProbe(out),))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == 0, child.exitcode
    return out.read_text()


@pytest.mark.parametrize("name", ["EngineCore", "EngineCore_DP1", "VllmWorker-0"])
def test_a_child_vllm_spawns_unpickles_its_start_with_the_collector_off(tmp_path, name):
    assert _collector_while_unpickling(tmp_path, name) == "False"


def test_any_other_spawned_child_keeps_its_collector(tmp_path):
    assert _collector_while_unpickling(tmp_path, "Process-7") == "True"


@pytest.fixture
def collector_on():
    gc.enable()
    yield
    gc.enable()


@pytest.mark.parametrize("start,module,cls", [("run_engine_core", "vllm.v1.engine.core", "EngineCoreProc"),
                                               ("worker_main", "vllm.v1.executor.multiproc_executor", "WorkerProc")])
def test_each_start_function_turns_the_collector_back_on(monkeypatch, collector_on, start, module, cls):
    # vLLM's classes and start functions are stand-ins here (no vLLM import): the subject is
    # the collector's state when vLLM's start function is called.
    seen = []
    monkeypatch.setitem(sys.modules, module, types.SimpleNamespace(**{cls: object}))
    monkeypatch.setitem(vllm_core_guard._originals, start, lambda: seen.append(gc.isenabled()))
    monkeypatch.setattr(vllm_core_guard, "die_with_parent_process", lambda: None)
    monkeypatch.setattr(vllm_core_guard, "_install_for_workers", lambda: None)
    monkeypatch.setattr(vllm_core_guard, "skip_the_sweep_at_exit", lambda: None)
    gc.disable()
    getattr(vllm_core_guard, start)()
    assert seen == [True]


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


class EngineFailed(Exception):
    pass


def _fail():
    raise EngineFailed


@pytest.mark.parametrize("start,module,cls", [("run_engine_core", "vllm.v1.engine.core", "EngineCoreProc"),
                                               ("worker_main", "vllm.v1.executor.multiproc_executor", "WorkerProc")])
@pytest.mark.parametrize("how", ["returns", "raises"])
def test_once_the_start_function_ends_the_heap_is_frozen_for_the_exit(monkeypatch, unfrozen, start, module, cls, how):
    # The process only exits after vLLM's start function, and the interpreter's exit sweeps
    # what is not frozen: nothing is frozen while vLLM runs, everything once it is done.
    seen = []
    monkeypatch.setitem(sys.modules, module, types.SimpleNamespace(**{cls: object}))
    monkeypatch.setitem(vllm_core_guard._originals, start,
                        lambda: seen.append(gc.get_freeze_count()) if how == "returns" else _fail())
    monkeypatch.setattr(vllm_core_guard, "die_with_parent_process", lambda: None)
    monkeypatch.setattr(vllm_core_guard, "_install_for_workers", lambda: None)
    if how == "returns":
        getattr(vllm_core_guard, start)()
        assert seen == [0]
    else:
        with pytest.raises(EngineFailed):
            getattr(vllm_core_guard, start)()
    assert gc.get_freeze_count() > 0
