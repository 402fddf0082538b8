"""Polling for a condition in tests that drive real processes: one loop, two answers.

``wait_until`` fails the test when the time is up; ``wait_for`` says whether the condition
came true (for ``assert wait_for(...)``). Both poll ``pred`` every ``every`` seconds; a
``pred`` may raise to stop the wait at once (a process that died, a job that failed)."""

from __future__ import annotations

import time


def poll(pred, timeout: float, every: float = 0.05):
    """``pred()``'s first truthy value within ``timeout`` seconds, else its last (falsy) one."""
    end = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() >= end:
            return v
        time.sleep(every)


def wait_until(pred, timeout: float, what: str = "condition", *, every: float = 0.05):
    """Returns ``pred()``'s first truthy value; fails the test after ``timeout`` seconds."""
    v = poll(pred, timeout, every)
    if not v:
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
    return v


def wait_for(pred, timeout: float = 5.0, *, every: float = 0.01):
    """``pred()``'s first truthy value within ``timeout`` seconds, else its last one: for a
    test that asserts the outcome itself."""
    return poll(pred, timeout, every)
