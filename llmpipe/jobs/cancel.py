"""Job cancellation: a durable flag every stage checks, plus a broadcast that lets the
inference worker abort requests already running in the engine."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger("llmpipe.jobs.cancel")

CHANNEL = "llmpipe:cancel"


def cancel_key(job_id: str) -> str:
    return f"llmpipe:cancelled:{job_id}"


def request_cancel(r: Any, job_id: str, ttl_s: int) -> None:
    pipe = r.pipeline(transaction=False)
    pipe.set(cancel_key(job_id), 1, ex=ttl_s)
    pipe.publish(CHANNEL, job_id)
    pipe.execute()


def cancelled(r: Any, job_ids: Iterable[str]) -> set[str]:
    ids = list(dict.fromkeys(job_ids))
    if not ids:
        return set()
    flags = r.mget([cancel_key(j) for j in ids])
    return {j for j, f in zip(ids, flags, strict=True) if f is not None}


class CancelListener:
    """Calls ``on_cancel(job_id)`` for each cancelled job among those ``running()`` lists.

    The broadcast is the fast path; the durable flag is the truth. Pub/sub delivers only to
    a live subscription, so a cancel sent while it was down (a Redis blip, a reconnect, a
    worker that subscribed late) would let its job run to the end. So every
    ``sweep_every_s`` the flags of the running jobs are read as well (one MGET), and once
    at each (re)subscription. ``on_cancel`` must be idempotent: both paths report a job."""

    def __init__(self, r: Any, on_cancel: Callable[[str], None],
                 running: Callable[[], Iterable[str]] | None = None, *, sweep_every_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self.r = r
        self.on_cancel = on_cancel
        self.running = running
        self.sweep_every_s = sweep_every_s
        self._clock = clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmpipe-cancel-listener", daemon=True)
        self._thread.start()

    def sweep(self) -> list[str]:
        """Report the running jobs whose cancel flag is set; returns them."""
        ids = list(self.running()) if self.running is not None else []
        gone = sorted(cancelled(self.r, ids))
        for job_id in gone:
            self.on_cancel(job_id)
        return gone

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                ps = self.r.pubsub(ignore_subscribe_messages=True)
                ps.subscribe(CHANNEL)
                self.sweep()
                due = self._clock() + self.sweep_every_s
                while not self._stop.is_set():
                    msg = ps.get_message(timeout=max(0.0, min(1.0, due - self._clock())))
                    if msg and msg.get("type") == "message":
                        data = msg["data"]
                        self.on_cancel(data.decode() if isinstance(data, bytes) else data)
                    if self._clock() >= due:
                        self.sweep()
                        due = self._clock() + self.sweep_every_s
                ps.close()
            except Exception:
                log.warning("cancel listener lost redis; retrying", exc_info=True)
                self._stop.wait(1.0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=3)
