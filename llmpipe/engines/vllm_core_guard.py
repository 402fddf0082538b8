"""vLLM's engine-core process dies with the worker that started it.

With V1 multiprocessing (vLLM's default) the model runs in a child process,
``VLLM::EngineCore``. When the inference worker is killed with SIGKILL nothing tells that
child: it lives on as an orphan (PPID 1) holding the model's memory (about 1.5 GB with the
tiny model on CPU, the GPU's memory on a GPU), whether the worker ran under ``llmpipe up``
or alone on another host. ``install`` swaps vLLM's engine-core entry point for one that
first asks the kernel (``PR_SET_PDEATHSIG``) to SIGKILL the engine core when its parent
goes, so no poll and no delay. SIGKILL rather than SIGTERM: nobody is left to serve, and
vLLM's SIGTERM handler waits for the busy loop, which a wedged GPU may never leave.
The executor workers below the engine core (``VLLM::Worker``, one per GPU rank) get the
same guard.

The kernel sends the signal when the *thread* that started the child ends: for the engine
core, the engine's event-loop thread (llmpipe/engines/vllm_engine.py), which ends only
after the engine has shut down and its engine core has exited; for the executor workers,
the engine core's main thread, which builds its executor.
"""

from __future__ import annotations

import ctypes
import gc
import multiprocessing
import os
import signal
from typing import Any

_PR_SET_PDEATHSIG = 1
# vLLM's entry points, in the process that installed the guard (and in its forks).
_originals: dict[str, Any] = {}
# The names vLLM gives the processes it starts with multiprocessing (its CPU platform always
# spawns them): the engine core (EngineCore_DP<i> with data parallelism) and executor workers.
VLLM_CHILDREN = ("EngineCore", "VllmWorker-")


def pause_collector_in_a_spawned_child() -> bool:
    """In a process that vLLM spawns, this module is imported while the child unpickles its
    start function (run_engine_core, worker_main), before vLLM's own modules, which the
    start's arguments import next: the collector stays off through that import
    (llmpipe/observability/heap.py, collector_paused), until the start function runs."""
    if not multiprocessing.current_process().name.startswith(VLLM_CHILDREN):
        return False
    gc.disable()
    return True


pause_collector_in_a_spawned_child()


def _patch(cls: type, name: str, replacement) -> None:
    current = cls.__dict__[name]
    fn = current.__func__ if isinstance(current, staticmethod) else current
    if fn is replacement:
        return
    _originals[name] = fn
    # A module-level function: a spawned child unpickles it by name and so imports this
    # module, where vLLM's class is unpatched and its own entry point is found again.
    setattr(cls, name, staticmethod(replacement))


def _original(cls: type, name: str, replacement):
    fn = _originals.get(name)
    if fn is None:  # started by spawn: this process imported vLLM afresh
        fn = getattr(cls, name)
        if fn is replacement:  # pragma: no cover - would recurse
            raise RuntimeError(f"vLLM's {cls.__name__}.{name} was lost")
    return fn


def install() -> None:
    """Route vLLM's engine-core start (and its executor workers' start) through the guard;
    idempotent."""
    from vllm.v1.engine.core import EngineCoreProc

    _patch(EngineCoreProc, "run_engine_core", run_engine_core)
    _install_for_workers()


def _install_for_workers() -> None:
    try:
        from vllm.v1.executor.multiproc_executor import WorkerProc
    except ImportError:  # pragma: no cover - another vLLM layout: the engine core is still guarded
        return
    _patch(WorkerProc, "worker_main", worker_main)


def run_engine_core(*args: Any, **kwargs: Any) -> Any:
    """In the engine-core process: die with the parent, then run vLLM's engine core."""
    from vllm.v1.engine.core import EngineCoreProc

    gc.enable()  # paused since this module's import (pause_collector_in_a_spawned_child)
    die_with_parent_process()
    _install_for_workers()  # the engine core's own children, in this (maybe spawned) process
    try:
        return _original(EngineCoreProc, "run_engine_core", run_engine_core)(*args, **kwargs)
    finally:
        skip_the_sweep_at_exit()


def worker_main(*args: Any, **kwargs: Any) -> Any:
    """In an executor worker (``VLLM::Worker``, below the engine core): the same. vLLM's own
    death pipe stops it too, but only about 10 s later (measured on CPU), holding the
    model's memory meanwhile."""
    from vllm.v1.executor.multiproc_executor import WorkerProc

    gc.enable()  # as in run_engine_core
    die_with_parent_process()
    try:
        return _original(WorkerProc, "worker_main", worker_main)(*args, **kwargs)
    finally:
        skip_the_sweep_at_exit()


def skip_the_sweep_at_exit() -> None:
    """Called once the process's work is done and it only exits. The interpreter's exit
    collects the whole heap (vLLM's shutdown unfreezes what its start froze), millions of
    torch's and vLLM's objects: that took the engine core longer than the 5 s vLLM's client
    gives it before a SIGKILL, and the executor worker about 3 s, so that every engine's
    shutdown took 5 s (measured on CPU). Frozen, nothing is walked; the memory goes with the
    process, as vLLM's own clean exit on ROCm does it."""
    gc.freeze()


def die_with_parent_process(sig: int = signal.SIGKILL) -> None:
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: nothing to ask the kernel
        return
    prctl(_PR_SET_PDEATHSIG, sig)
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # it died before prctl took effect
        os._exit(1)


__all__ = ["die_with_parent_process", "install", "pause_collector_in_a_spawned_child", "run_engine_core",
           "skip_the_sweep_at_exit", "worker_main"]
