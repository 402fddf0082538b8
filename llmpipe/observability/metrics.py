"""Prometheus metrics, shared by the API and every worker process.

Workers get their numbers to the scrape through prometheus-client's multiprocess mode:
every process writes to files in ``PROMETHEUS_MULTIPROC_DIR`` and the API's ``/metrics``
aggregates them. ``llmpipe up`` sets that folder; in compose it is a shared volume. Files
are named by host and pid so containers sharing the volume do not collide.
"""

from __future__ import annotations

import os
import socket

if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    from prometheus_client import values as _values

    _ident = f"{socket.gethostname().replace('_', '-')}-"
    _values.ValueClass = _values.MultiProcessValue(lambda: _ident + str(os.getpid()))

from prometheus_client import Counter, Gauge, Histogram  # noqa: E402

from llmpipe.messages import StageTiming  # noqa: E402

_LAT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

# ``model``: the served model's name (llmpipe/models/served.py), so that each model's
# latency and batching read on their own when several share the API.
STAGE_QUEUE_WAIT = Histogram("llmpipe_stage_queue_wait_seconds", "Time a message waited in a stage's queue.", ["stage", "model"], buckets=_LAT)
STAGE_RUN = Histogram("llmpipe_stage_run_seconds", "Time a stage spent on one message.", ["stage", "model"], buckets=_LAT)
BATCH_SIZE = Histogram("llmpipe_batch_size_requests", "Requests per engine batch.", ["model"], buckets=(1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128))
BATCH_WAIT = Histogram("llmpipe_batch_wait_seconds", "Time the first request of a batch waited for the batch to form.", ["model"], buckets=_LAT)
TTFT = Histogram("llmpipe_time_to_first_token_seconds", "From job submission to the engine's first output token.", ["model"], buckets=_LAT)
E2E = Histogram("llmpipe_e2e_latency_seconds", "From job submission to its collected result.", ["model"], buckets=_LAT)
ADMITTED = Counter("llmpipe_requests_admitted_total", "Jobs accepted by admission control.")
REJECTED = Counter("llmpipe_requests_rejected_total", "Jobs rejected by admission control.", ["reason"])
FINISHED = Counter("llmpipe_jobs_finished_total", "Jobs that reached a terminal state.", ["status"])
EXPIRED = Counter("llmpipe_requests_expired_total", "Prompts that passed their deadline.", ["stage"])
CANCELLED = Counter("llmpipe_requests_cancelled_total", "Prompts cancelled by their client.", ["stage"])
ENGINE_ABORTS = Counter("llmpipe_engine_aborts_total", "Requests the engine stopped generating (cancel, client gone, deadline).")
# A model with several inference workers: the requests add up over its live workers, the KV
# cache use is the fullest worker's.
ENGINE_RUNNING = Gauge("llmpipe_engine_running_requests", "Requests the engine is generating.", ["model"], multiprocess_mode="livesum")
ENGINE_WAITING = Gauge("llmpipe_engine_waiting_requests", "Requests waiting inside the engine.", ["model"], multiprocess_mode="livesum")
ENGINE_KV = Gauge("llmpipe_engine_kv_cache_usage_ratio", "Share of the KV cache in use (0-1).", ["model"], multiprocess_mode="livemax")
BATCHER_PENDING = Gauge("llmpipe_batcher_pending_requests", "Requests waiting in the inference worker's batcher.", ["model"], multiprocess_mode="livesum")
# Prefix-aware routing (llmpipe/routing/router.py), counted by the preprocess processes that decide.
ROUTE_REQUESTS = Counter("llmpipe_route_requests_total", "Inference requests placed by prefix-aware routing: routed (to "
                         "the worker its prefix prefers), spilled (that worker had no room: another worker, or the shared "
                         "queue), queued (the shared queue, behind the requests waiting there), fallback (the shared "
                         "queue without a decision).", ["model", "outcome", "match"])
ROUTE_WORKERS = Gauge("llmpipe_route_live_workers", "Live inference workers of a model, as routing last saw them.", ["model"],
                      multiprocess_mode="mostrecent")
# The engine's prefix cache, per inference worker (``worker``: its node name), as vLLM counts it:
# hit rate = rate(hits) / rate(queries), both in prompt tokens.
PREFIX_CACHE_QUERIES = Counter("llmpipe_engine_prefix_cache_queries_total", "Prompt tokens looked up in the engine's "
                               "prefix cache.", ["model", "worker"])
PREFIX_CACHE_HITS = Counter("llmpipe_engine_prefix_cache_hits_total", "Prompt tokens found in the engine's prefix cache.",
                            ["model", "worker"])

# The Batch API (api/batches/): lines written to a batch's output (completed) or error file
# (failed), and lines submitted and not written yet, per served model ("" before the line's
# model is known: a line that failed its checks). Batches per status are read from Redis at
# each scrape (api/batches/metrics.py).
BATCH_LINES = Counter("llmpipe_batch_lines_total", "Batch lines written, by outcome.", ["model", "outcome"])
BATCH_LINES_IN_FLIGHT = Gauge("llmpipe_batch_lines_in_flight", "Batch lines submitted as jobs and not written yet.",
                              ["model"], multiprocess_mode="livesum")

def observe_stage(t: StageTiming, model: str) -> None:
    observe_stage_times(t.stage.value, t.queue_wait_s, t.run_s, model)


def observe_stage_times(stage: str, queue_wait_s: float, run_s: float, model: str) -> None:
    STAGE_QUEUE_WAIT.labels(stage, model).observe(queue_wait_s)
    STAGE_RUN.labels(stage, model).observe(run_s)


def observe_error(reason: str | None, stage: str) -> None:
    if reason == "expired":
        EXPIRED.labels(stage).inc()
    elif reason == "cancelled":
        CANCELLED.labels(stage).inc()
