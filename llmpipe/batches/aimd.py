"""How many lines a batch keeps in flight: additive increase, multiplicative decrease.

Admission control answers 429 when the batch lane's share of the queues is full
(llmpipe/jobs/admission.py). A feeder that kept its full window would resubmit into the
refusal; instead, as TCP's congestion window (and llm-d's batch gateway), the window grows
by one line per window's worth of admitted lines and halves on a 429. A burst of 429s from
lines submitted at once halves it once: after a decrease, further refusals within
``hold_s`` change nothing, as TCP halves once per round trip.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable


class Aimd:
    def __init__(self, max_window: int, *, min_window: int = 1, initial: float | None = None,
                 decrease: float = 0.5, increase: float = 1.0, hold_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        if not 0 < decrease < 1:
            raise ValueError("decrease must be in (0, 1)")
        self.max_window = max(1, max_window)
        self.min_window = max(1, min(min_window, self.max_window))
        self.decrease = decrease
        self.increase = increase
        self.hold_s = hold_s
        self._clock = clock
        self._w = float(self.max_window if initial is None else min(max(initial, self.min_window), self.max_window))
        self._last_cut: float | None = None
        self.cuts = 0

    @property
    def window(self) -> int:
        """Lines that may be in flight now."""
        return max(self.min_window, math.floor(self._w))

    def admitted(self) -> None:
        """A line was admitted: one more line per window's worth of admissions."""
        self._w = min(float(self.max_window), self._w + self.increase / self._w)

    def overloaded(self, now: float | None = None) -> bool:
        """Admission refused a line (429): halve the window, once per ``hold_s``. Returns
        whether it was cut."""
        if now is None:
            now = self._clock()
        if self._last_cut is not None and now - self._last_cut < self.hold_s:
            return False
        self._w = max(float(self.min_window), self._w * self.decrease)
        self._last_cut = now
        self.cuts += 1
        return True
