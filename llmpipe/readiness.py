"""Which stages have a worker ready to serve, for the API's ``GET /health``.

vLLM's ``/health`` answers 200 once its engine can serve and 503 otherwise, and clients
probe it before they send work. Here the engine lives in another process, so each worker,
once warm (the inference worker after its engine loaded), keeps a short-lived key per
stage it serves in Redis; the API reads them. A worker that dies stops refreshing its keys
and they expire within ``ttl_s``; one that shuts down deletes them at once.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger("llmpipe.worker")

# What a job needs: every stage of the chain and the chord callback.
STAGES = ("preprocess", "inference", "postprocess", "collect")
_PREFIX = "llmpipe:ready:"


def key(stage: str, node: str) -> str:
    return f"{_PREFIX}{stage}:{node}"


class ReadinessBeacon:
    """Refreshes ``llmpipe:ready:<stage>:<node>`` for each stage, every ``every_s``."""

    def __init__(self, r: Any, stages: list[str], node: str, *, ttl_s: int = 15, every_s: float = 5.0):
        self.r = r
        self.keys = [key(s, node) for s in stages]
        self.ttl_s = ttl_s
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="llmpipe-readiness", daemon=True)

    def start(self) -> ReadinessBeacon:
        self.beat()
        self._thread.start()
        return self

    def beat(self) -> None:
        try:
            pipe = self.r.pipeline(transaction=False)
            for k in self.keys:
                pipe.set(k, "1", ex=self.ttl_s)
            pipe.execute()
        except Exception:  # Redis away: the keys expire and /health says so
            log.debug("readiness beat failed", exc_info=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.beat()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        try:
            if self.keys:
                self.r.delete(*self.keys)
        except Exception:
            log.debug("could not clear readiness keys", exc_info=True)


def ready_stages(r: Any) -> set[str]:
    """The stages with at least one ready worker now."""
    return {k.decode().removeprefix(_PREFIX).split(":", 1)[0] if isinstance(k, bytes)
            else k.removeprefix(_PREFIX).split(":", 1)[0]
            for k in r.scan_iter(match=f"{_PREFIX}*", count=1000)}


def missing_stages(r: Any) -> list[str]:
    ready = ready_stages(r)
    return [s for s in STAGES if s not in ready]
