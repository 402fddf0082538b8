"""Polling for a condition in tests that drive real processes, with one bounded wait."""

from __future__ import annotations

import time


def wait_until(pred, timeout: float, what: str = "condition", *, every: float = 0.05):
    """Returns ``pred()``'s first truthy value; fails the test after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
