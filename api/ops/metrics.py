"""What ``/metrics`` answers: this process's metrics plus every worker's, live queue depths and
live workers per stage."""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, multiprocess
from prometheus_client.core import GaugeMetricFamily

from llmpipe.observability.readiness import STAGES, live_workers
from llmpipe.stages import COLLECT, Stage

_STAGE_QUEUES = tuple(s.value for s in Stage)  # with one model: its inference queue is ``inference``


class QueueDepthCollector:
    """``depths``: a reader of llmpipe/broker/queue_depth.py (Redis lists or RabbitMQ queues)."""

    def __init__(self, depths: Any, queues: tuple[str, ...] = _STAGE_QUEUES, models: dict[str, str] | None = None):
        """``queues``: every stage queue, each model's inference queue included; ``models``:
        queue -> the model it serves (an inference queue), for the ``model`` label."""
        self.depths = depths
        self.queues = queues
        self.models = models or {}

    def collect(self):
        g = GaugeMetricFamily("llmpipe_queue_depth_messages", "Messages waiting in each stage queue.",
                              labels=["queue", "model"])
        try:
            sample = self.depths.sample((*self.queues, COLLECT))
        except Exception:  # a scrape while the broker is down reports no depth rather than failing
            return
        for q, d in sample.depths.items():
            g.add_metric([q, self.models.get(q, "")], d)  # "": a CPU queue, shared by every model
        yield g


class LiveWorkersCollector:
    """Warm, live workers per stage, from the readiness keys (llmpipe/observability/readiness.py): 0 for
    15 s at most after a stage's last worker died."""

    def __init__(self, r: Any, stages: tuple[str, ...] = STAGES):
        self.r = r
        self.stages = stages

    def collect(self):
        g = GaugeMetricFamily("llmpipe_stage_live_workers", "Warm workers alive for each stage (readiness keys).",
                              labels=["stage"])
        try:
            counts = live_workers(self.r, self.stages)
        except Exception:  # a scrape while Redis is down reports no count rather than failing
            return
        for stage, n in counts.items():
            g.add_metric([stage], n)
        yield g


def build_registries(depths: Any, r: Any, served: Any = None, extra: tuple = ()) -> list[CollectorRegistry]:
    """Every process's metrics (multiprocess files, or this process alone) and the queue depths;
    ``extra``: more collectors of live state (the batches per status)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        processes = CollectorRegistry()
        multiprocess.MultiProcessCollector(processes)
    else:
        processes = REGISTRY
    live = CollectorRegistry()
    if served is None:
        live.register(QueueDepthCollector(depths))
        live.register(LiveWorkersCollector(r))
    else:  # llmpipe/models/served.py ModelSet: each model's inference queue
        live.register(QueueDepthCollector(depths, served.stage_queues(), {m.queue: m.name for m in served.models}))
        live.register(LiveWorkersCollector(r, served.readiness_stages()))
    for collector in extra:
        live.register(collector)
    return [processes, live]

