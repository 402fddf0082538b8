"""``/metrics``: this process's metrics plus every worker's, and live queue depths."""

from __future__ import annotations

import os
from typing import Any

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from llmpipe.admission import STAGE_QUEUES


class QueueDepthCollector:
    def __init__(self, r: Any):
        self.r = r

    def collect(self):
        g = GaugeMetricFamily("llmpipe_queue_depth_messages", "Messages waiting in each stage queue.", labels=["queue"])
        pipe = self.r.pipeline(transaction=False)
        queues = (*STAGE_QUEUES, "collect")
        for q in queues:
            pipe.llen(q)
        try:
            depths = pipe.execute()
        except Exception:  # a scrape while Redis is down reports no depth rather than failing
            return
        for q, d in zip(queues, depths, strict=True):
            g.add_metric([q], d)
        yield g


def build_registries(r: Any) -> list[CollectorRegistry]:
    """Every process's metrics (multiprocess files, or this process alone) and the queue depths."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        processes = CollectorRegistry()
        multiprocess.MultiProcessCollector(processes)
    else:
        processes = REGISTRY
    live = CollectorRegistry()
    live.register(QueueDepthCollector(r))
    return [processes, live]


def router(registries: list[CollectorRegistry]) -> APIRouter:
    rt = APIRouter(tags=["ops"])

    @rt.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    def metrics(_: Request) -> Response:
        """Prometheus metrics of the API and all workers (multiprocess mode)."""
        return Response(b"".join(generate_latest(reg) for reg in registries), media_type=CONTENT_TYPE_LATEST)

    return rt
