"""The command line of each worker kind: queue, pool, concurrency and prefetch."""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass

from llmpipe.engines.vllm_batch_defaults import Device, default_max_num_seqs
from llmpipe.settings import EngineKind, Settings
from llmpipe.stages import COLLECT, CPU_STAGES, Stage, inference_queue

# The kind a worker was started as (``llmpipe worker KIND``, ``llmpipe up``); what it warms
# and whether it runs the watchdog follow it (workers/pool_policy.py).
KIND_ENV = "LLMPIPE_WORKER_KIND"


@dataclass(frozen=True)
class WorkerKind:
    name: str
    queues: tuple[str, ...]
    pool: str
    prefetch: int

    def concurrency(self, s: Settings) -> int:
        if self.name == Stage.INFERENCE:
            # One thread per request in flight: as many as the engine runs, and as many again
            # waiting to take their places (a thread only waits on its request's future).
            return max(4, 2 * engine_running(s))
        if self.name == COLLECT:
            return 1
        return max(1, s.cpu_workers)


def engine_running(s: Settings, device: Device | None = None) -> int:
    """How many requests the engine runs at once, as the inference worker sizes itself: vLLM's
    running set (``max_num_seqs``, vLLM's own for ``device`` where unset: this host's when
    None; sized by the dispatch batch instead, 64 threads held vLLM to 64 of its 128 on a CPU:
    a batch made 442.9 tok/s there against 482.1 with 256, docs/benchmarks.md "The Batch
    API"); another engine's dispatch batch (``max_batch_size``)."""
    if s.engine == EngineKind.VLLM:
        return max(s.max_batch_size, s.max_num_seqs or default_max_num_seqs(s, device))
    return s.max_batch_size


_PRE, _INF, _POST = Stage.PREPROCESS.value, Stage.INFERENCE.value, Stage.POSTPROCESS.value
KINDS: dict[str, WorkerKind] = {
    # CPU pools: prefork, one reserved message per process so no process hoards work.
    _PRE: WorkerKind(_PRE, (_PRE,), "prefork", 1),
    # The chord callback is light; postprocess workers also serve it unless a collect
    # worker is run on its own.
    _POST: WorkerKind(_POST, (_POST, COLLECT), "prefork", 1),
    COLLECT: WorkerKind(COLLECT, (COLLECT,), "solo", 1),
    # The engine lives in one process: AsyncLLM spawns a child, so never a daemonic
    # prefork child. Threads hand requests to the in-process batcher.
    _INF: WorkerKind(_INF, (_INF,), "threads", 1),
}


def pool_of(kind: str, s: Settings) -> str:
    """The CPU stages' pool is a setting (cpu_pool); the others' are fixed."""
    k = KINDS[kind]
    return s.cpu_pool if kind in CPU_STAGES else k.pool


def queues_of(kind: str, s: Settings, model: str | None = None) -> tuple[str, ...]:
    """The queues a worker of ``kind`` consumes. An inference worker serves one model
    (``model``, default the first): its queue, ``inference`` with one model, else
    ``inference.<name>`` (llmpipe/models/served.py). The CPU stages serve every model."""
    if kind == Stage.INFERENCE:
        return (s.served.get(model).queue,)
    return KINDS[kind].queues


def node_of(kind: str, s: Settings, model: str | None = None) -> str:
    """``inference.tiny`` for one model's inference worker when there are several, else the kind."""
    several = kind == Stage.INFERENCE and s.served.several
    return inference_queue(s.served.get(model).name) if several else kind


def worker_argv(kind: str, s: Settings, *, concurrency: int | None = None, name: str | None = None,
                loglevel: str = "INFO", model: str | None = None) -> list[str]:
    k = KINDS[kind]
    n = concurrency or k.concurrency(s)
    return [
        sys.executable, "-m", "celery", "-A", "tasks", "worker",
        "-Q", ",".join(queues_of(kind, s, model)),
        "-P", pool_of(kind, s),
        "-c", str(n),
        "-n", name or f"{node_of(kind, s, model)}@%h",  # Celery expands %h to the host name
        "--prefetch-multiplier", str(k.prefetch),
        # Mingle makes each starting worker wait a second for its peers' revoked task ids
        # and clocks; llmpipe cancels through its own flags (llmpipe/jobs/cancel.py), never by
        # revoke, so a started or restarted worker takes messages a second sooner without it.
        "--without-mingle",
        *(["-E"] if s.task_events else []),
        "-l", loglevel,
    ]


def celery_command(kind: str, s: Settings, **kw) -> str:
    """The ``celery ... worker`` line that ``llmpipe worker KIND`` runs, as a user types it."""
    return shlex.join(["celery", *worker_argv(kind, s, **kw)[3:]])
