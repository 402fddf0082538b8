"""``llmpipe_batches``: batches per status, read from Redis at each scrape (the counts every
status move keeps, llmpipe/batches/records.py), so every API process reports the whole stack's."""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily

from llmpipe.batches.records import BatchStatus, BatchStore


class BatchesCollector:
    def __init__(self, store: BatchStore):
        self.store = store

    def collect(self):
        g = GaugeMetricFamily("llmpipe_batches", "Batches (OpenAI Batch API) in each status.", labels=["status"])
        try:
            counts = self.store.counts()
        except Exception:  # a scrape while Redis is down reports no count rather than failing
            return
        for status in BatchStatus:
            g.add_metric([status.value], counts.get(status.value, 0))
        yield g
