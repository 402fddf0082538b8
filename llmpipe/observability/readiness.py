"""Which stages have a worker ready to serve, for the API's ``GET /health`` and
``GET /healthz`` and the ``llmpipe_stage_live_workers`` gauge.

vLLM's ``/health`` answers 200 once its engine can serve and 503 otherwise, and clients
probe it before they send work. Here the engine lives in another process, so each worker,
once warm (the inference worker after its engine loaded), keeps a short-lived key per
stage it serves in Redis; the API reads them. A worker that dies stops refreshing its keys
and they expire within ``ttl_s`` (15 s: 10-15 s after a SIGKILL, since the last refresh
was 0-5 s before it); one that shuts down deletes them at once.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from llmpipe.stages import STAGE_QUEUES

log = logging.getLogger("llmpipe.worker")

# What a job needs: every stage of the chain and the chord callback.
STAGES = STAGE_QUEUES
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


def live_workers(r: Any, stages: tuple[str, ...] = STAGES) -> dict[str, int]:
    """How many warm, live workers each stage has now (every one of ``stages`` named, 0
    included). With several models each model's inference queue is a stage of its own
    (``inference.tiny``, llmpipe/models/served.py ModelSet.readiness_stages)."""
    counts = dict.fromkeys(stages, 0)
    for k in r.scan_iter(match=f"{_PREFIX}*", count=1000):
        stage = (k.decode() if isinstance(k, bytes) else k).removeprefix(_PREFIX).split(":", 1)[0]
        counts[stage] = counts.get(stage, 0) + 1
    return counts


def ready_stages(r: Any, stages: tuple[str, ...] = STAGES) -> set[str]:
    """The stages with at least one ready worker now."""
    return {stage for stage, n in live_workers(r, stages).items() if n}


def missing_stages(r: Any, stages: tuple[str, ...] = STAGES) -> list[str]:
    ready = ready_stages(r, stages)
    return [s for s in stages if s not in ready]
