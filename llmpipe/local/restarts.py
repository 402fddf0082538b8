"""When ``llmpipe up`` restarts a child that exited on its own, and when it gives up.

One policy per child. The delay doubles with each crash in a row (1 s, 2 s, 4 s, ... at
most 30 s), so a child that dies at once on every start does not spin, and goes back to
1 s once the child has stayed up for ``stable_s``: a worker killed once a day restarts at
once every time. The policy gives up on the ``max_crashes``-th crash within ``window_s``:
by then a restart is unlikely to help, and a person (or systemd, or Docker's restart
policy, one level up) should look.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Decision:
    """What to do about one crash: restart after ``delay_s``, or give up (``delay_s`` None)."""

    delay_s: float | None
    crashes: int  # in the window, this one included
    max_crashes: int
    window_s: float

    @property
    def give_up(self) -> bool:
        return self.delay_s is None


class RestartPolicy:
    def __init__(self, max_crashes: int = 5, window_s: float = 300.0, *, first_delay_s: float = 1.0,
                 max_delay_s: float = 30.0, stable_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        if max_crashes < 1:
            raise ValueError("max_crashes must be at least 1")
        self.max_crashes = max_crashes
        self.window_s = window_s
        self.first_delay_s = first_delay_s
        self.max_delay_s = max_delay_s
        self.stable_s = stable_s
        self.clock = clock
        self._crashes: deque[float] = deque()
        self._streak = 0  # crashes in a row, each after less than stable_s up
        self._started_at: float | None = None

    def started(self, now: float | None = None) -> None:
        """The child was (re)started at ``now``."""
        if now is None:
            now = self.clock()
        self._started_at = now

    def crashed(self, now: float | None = None) -> Decision:
        """The child exited without being asked to, at ``now``: restart it when, or give up."""
        if now is None:
            now = self.clock()
        if self._started_at is not None and now - self._started_at >= self.stable_s:
            self._streak = 0
        self._crashes.append(now)
        while self._crashes and now - self._crashes[0] >= self.window_s:
            self._crashes.popleft()
        n = len(self._crashes)
        if n >= self.max_crashes:
            return Decision(None, n, self.max_crashes, self.window_s)
        delay = min(self.max_delay_s, self.first_delay_s * 2.0 ** self._streak)
        self._streak += 1
        return Decision(delay, n, self.max_crashes, self.window_s)


__all__ = ["Decision", "RestartPolicy"]
