"""Where a static batch's time goes: wall time and the engine thread's own CPU time, up to
the first token (the prefill) and per decode step after it.

On a GPU the engine thread waits for the kernels at each step's sync, so CPU well under
wall means the device (or a lock) is the limit, and CPU close to wall means Python
launching kernels is. The transformers engine logs one line per batch
(llmpipe/engines/hf_engine.py); the GPU run collects them (benchmarks/gpu/run.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

LOG_PREFIX = "transformers "  # the engine's line: this, then BatchTiming.describe()


@dataclass(frozen=True)
class BatchTiming:
    requests: int
    prompt_width: int  # the padded prompt length of the batch
    steps: int  # decode steps after the first token
    first_s: float  # wall time to the first token
    first_cpu_s: float
    decode_s: float  # wall time of the decode steps
    decode_cpu_s: float

    def describe(self) -> str:
        per = 1000.0 / self.steps if self.steps else 0.0
        return (f"batch of {self.requests}, prompt width {self.prompt_width}: first token {self.first_s * 1000:.0f} ms "
                f"(cpu {self.first_cpu_s * 1000:.0f}), {self.steps} decode steps {self.decode_s * per:.1f} ms each "
                f"(cpu {self.decode_cpu_s * per:.1f})")


class BatchTimer:
    """Started with the batch; ``first_token`` once the first token is chosen, ``step``
    after each decode forward, ``done`` at the end."""

    def __init__(self, requests: int, prompt_width: int, *, clock: Callable[[], float] = time.perf_counter,
                 cpu_clock: Callable[[], float] = time.thread_time):
        self._clock, self._cpu = clock, cpu_clock
        self._requests, self._width = requests, prompt_width
        self._start = (clock(), cpu_clock())
        self._first: tuple[float, float] | None = None
        self._steps = 0

    def first_token(self) -> None:
        if self._first is None:
            self._first = (self._clock(), self._cpu())

    def step(self) -> None:
        self._steps += 1

    def done(self) -> BatchTiming:
        end = (self._clock(), self._cpu())
        first = self._first if self._first is not None else end
        return BatchTiming(self._requests, self._width, self._steps, first[0] - self._start[0],
                           first[1] - self._start[1], end[0] - first[0], end[1] - first[1])


def log_line(t: BatchTiming) -> str:
    """The engine's log line for a batch's timing."""
    return LOG_PREFIX + t.describe()


def is_log_line(line: str) -> bool:
    """Whether a log line is a batch's timing (what ``log_line`` wrote)."""
    return f"{LOG_PREFIX}batch of " in line
