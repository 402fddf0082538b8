"""Calls that must arrive at once: each from its own thread, released together by a barrier,
so that a batcher sees them all in one window."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any


def call_together(fn: Callable[[Any], Any], args: Sequence[Any], timeout: float = 10.0) -> list[Any]:
    """``fn(a)`` for every ``a`` in ``args``, all released at once; the results in order (None
    where a call had not returned within ``timeout``)."""
    out: list[Any] = [None] * len(args)
    gate = threading.Barrier(len(args))

    def run(i: int) -> None:
        gate.wait()
        out[i] = fn(args[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return out
