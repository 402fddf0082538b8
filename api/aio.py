"""Waiting with a deadline on the API's event loop, without losing a cancel.

Not ``asyncio.wait_for``: on Python 3.11, when the waiting task is cancelled just as the
awaited future completes, ``wait_for`` returns the future's result and the cancel is lost
(CPython bpo-42130, fixed in 3.12). A feeder that cancels a batch line then waits for it
forever, and a client that went away leaves its request running. ``asyncio.timeout`` counts
cancels (``Task.uncancel``) and never swallows one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable


async def within(aw: Awaitable, timeout: float) -> bool:
    """Await ``aw`` for at most ``timeout`` seconds: True if it finished, False if the time
    ran out first (``aw`` is then cancelled; shield it to keep it)."""
    try:
        async with asyncio.timeout(timeout):
            await aw
    except TimeoutError:
        return False
    return True
