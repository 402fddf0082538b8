"""A clock for tests of time-based logic, which takes its clock as an argument."""

from __future__ import annotations


class ManualClock:
    """A clock the test moves by hand: call it for the time, ``advance`` to move it."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt
