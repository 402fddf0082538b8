"""The pipeline's own processes kept off the CPUs that vLLM computes on, on one host.

vLLM on a CPU binds each rank's OpenMP threads to CPUs of their own
(``VLLM_CPU_OMP_THREADS_BIND=auto``) and leaves the rest, one or more per rank, to its
scheduler and to "other processes". ``vllm serve`` has one other process, its API server.
A local pipeline has several: the API, the CPU stages' pools, Flower and the embedded Redis.
Left to the kernel, they also run on the engine's CPUs, and each time one wakes there it
stops a forward pass midway. On a 2-core Xeon with AMX (docs/benchmarks.md), keeping them
on the CPU vLLM leaves free raised streamed completions at 32 clients from 284 to 388
output tokens/s: the engine's CPU per request fell from 204 to 149 ms.

The engine's CPUs are read from the engine, not predicted: they are the affinities of the
inference workers' descendants (vLLM's worker processes) that are narrower than what this
process may use. An engine on a GPU binds nothing, so nothing moves. The inference worker's
own process (Celery, its batcher, vLLM's front end) moves too, once its engine has bound its
CPUs, and its engine's processes stay where vLLM put them: on a 2-core EPYC, streamed
completions and chat at 32 clients made 4-11 % more tokens/s in four A/B pairs than with
that process unbound, as ``vllm serve``'s API server is (docs/benchmarks.md).

Flower is the exception: it watches, and no request waits for it. On the free CPU it woke
for every task event and ran between a request's hops: on a 2-core EPYC, one streamed
completion at a time waited 2-4 ms less in the stages' queues with Flower on the engine's CPU
at nice 10 (eight alternated runs) and 32 clients made as many tokens/s (docs/benchmarks.md).
There it takes what it uses, about 1 % of that CPU at 32 clients, and yields to the forward
passes whenever both want to run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable

from llmpipe.local.supervisor import descendants

Affinity = Callable[[int], frozenset[int]]

# A watcher's niceness on the engine's CPUs: ~10 % of a CPU against a forward pass at nice 0
# (the kernel's weights, 110 against 1024), ample for Flower's ~1 %.
WATCHER_NICE = 10


def affinity(pid: int) -> frozenset[int]:
    return frozenset(os.sched_getaffinity(pid))


def engine_cpus(roots: Iterable[int], host: frozenset[int], *, below: Callable[[int], set[int]] = descendants,
                affinity_of: Affinity = affinity) -> frozenset[int]:
    """The CPUs that processes under ``roots`` are bound to, where a binding is narrower than ``host``."""
    bound: set[int] = set()
    for root in roots:
        for pid in below(root):
            try:
                cpus = affinity_of(pid)
            except OSError:  # gone since it was listed
                continue
            if cpus < host:
                bound |= cpus
    return frozenset(bound)


def free_cpus(host: frozenset[int], engine: frozenset[int]) -> frozenset[int] | None:
    """The CPUs left to everything else; None when the engine binds none or all of them."""
    free = host - engine
    return free if engine and free else None


def pin(pid: int, cpus: frozenset[int]) -> int:
    """Binds every thread of ``pid`` and of its descendants to ``cpus``; how many threads.
    Threads and processes started later inherit the binding of the one that starts them."""
    return sum(pin_threads(p, cpus) for p in (pid, *descendants(pid)))


def pin_threads(pid: int, cpus: frozenset[int]) -> int:
    """Binds every thread of ``pid`` itself, not its children, to ``cpus``; how many threads."""
    n = 0
    for tid in _threads(pid):
        try:
            os.sched_setaffinity(tid, cpus)
            n += 1
        except OSError:  # exited meanwhile
            pass
    return n


def lower_threads(pid: int, nice: int) -> int:
    """Sets every thread of ``pid`` itself to niceness ``nice``; how many threads. Threads
    started later inherit the niceness of the one that starts them."""
    n = 0
    for tid in _threads(pid):
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
            n += 1
        except OSError:  # exited meanwhile
            pass
    return n


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:  # gone
        return []


def supported() -> bool:
    """CPU affinity is Linux's (and so are vLLM's CPU bindings)."""
    return hasattr(os, "sched_setaffinity") and hasattr(os, "sched_getaffinity")


class Placement:
    """Where a host's non-engine processes run: unknown until the engines are up (``learn``)."""

    def __init__(self, host: frozenset[int] | None = None):
        self.host = host if host is not None else affinity(0)
        self.cpus: frozenset[int] | None = None  # the free CPUs, once known

    def learn(self, engine_roots: Iterable[int], **probe) -> frozenset[int] | None:
        self.cpus = free_cpus(self.host, engine_cpus(engine_roots, self.host, **probe))
        return self.cpus

    @property
    def engine(self) -> frozenset[int] | None:
        """The CPUs the engines compute on, once known."""
        return None if self.cpus is None else self.host - self.cpus

    def apply(self, pids: Iterable[int]) -> None:
        if self.cpus is None:
            return
        for pid in pids:
            pin(pid, self.cpus)

    def apply_watcher(self, pid: int) -> None:
        """A process that only watches the pipeline (Flower), each thread of it and of its
        descendants, onto the engine's CPUs at ``WATCHER_NICE``."""
        if self.engine is None:
            return
        for p in (pid, *descendants(pid)):
            lower_threads(p, WATCHER_NICE)
            pin_threads(p, self.engine)

    def apply_front_end(self, pid: int, **probe) -> bool:
        """An inference worker's own process (Celery, its batcher, vLLM's front end) onto the
        free CPUs, its engine's processes left where vLLM bound them; False while its engine
        has bound no CPU yet. vLLM's ``auto`` binding reads the CPUs its process may use when
        the engine starts, so the worker moves only after that."""
        if self.cpus is None or not engine_cpus([pid], self.host, **probe):
            return False
        pin_threads(pid, self.cpus)
        return True

    def follow_front_end(self, pid: int, alive: Callable[[], bool], *, timeout_s: float,
                         clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                         every_s: float = 0.5) -> bool:
        """``apply_front_end`` once a (re)started inference worker's engine has bound its CPUs:
        whether it moved, within ``timeout_s`` and while ``alive()``."""
        deadline = clock() + timeout_s
        while alive() and clock() < deadline:
            if self.apply_front_end(pid):
                return True
            sleep(every_s)
        return False


__all__ = ["WATCHER_NICE", "Placement", "affinity", "engine_cpus", "free_cpus", "lower_threads", "pin", "pin_threads",
           "supported"]
