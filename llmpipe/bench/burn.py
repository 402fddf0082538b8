"""Simulated CPU work in the pre/post stages, for benchmark runs of the SIMULATED engine.

The real tokenizer is far cheaper than the 20 ms / 15 ms of CPU per request of the design
study, so ``llmpipe bench --engine simulated`` adds a busy loop that uses that much CPU
time (``Settings.sim_preprocess_cpu_ms`` / ``sim_postprocess_cpu_ms``).

The stages' code is not changed for this: the benchmark starts the workers with
``CELERY_LOADER=llmpipe.bench.burn:BurnLoader``, a Celery loader that connects a
``task_prerun`` handler burning the CPU before each preprocess / postprocess task.
Never used outside the benchmark.
"""

from __future__ import annotations

import time

from celery.loaders.app import AppLoader

LOADER = "llmpipe.bench.burn:BurnLoader"
TASKS = {"llmpipe.preprocess": "sim_preprocess_cpu_ms", "llmpipe.postprocess": "sim_postprocess_cpu_ms"}


def burn_cpu(ms: float) -> float:
    """Spin until this thread has used ``ms`` of CPU time; return the wall seconds it took."""
    if ms <= 0:
        return 0.0
    t0 = time.perf_counter()
    end = time.thread_time() + ms / 1000.0
    x = 0
    while time.thread_time() < end:
        for _ in range(200):
            x += 1
    return time.perf_counter() - t0


def _on_prerun(sender=None, task=None, **_):
    from llmpipe.settings import get_settings

    field = TASKS.get(getattr(task or sender, "name", ""))
    if field:
        burn_cpu(getattr(get_settings(), field))


class BurnLoader(AppLoader):
    """Celery's default app loader plus the CPU burn in the worker (before the pool forks)."""

    def init_worker(self):
        from celery.signals import task_prerun

        task_prerun.connect(_on_prerun, weak=False)
        return super().init_worker()
