"""What an inference worker runs around its engine: the InferenceProcessor (batcher, token
publisher, cancel listener) wired to this process's Redis and settings, the broker-queue
probe that tells the batcher more requests are coming, and the engine gauges."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis

from llmpipe.broker.queue_depth import AmqpDepths
from llmpipe.jobs import cancel
from llmpipe.jobs.lanes import Lane, batch_lane_slots, lane_for, queue_keys
from llmpipe.jobs.streaming import TokenPublisher, read_published
from llmpipe.messages import Detokenizing
from llmpipe.models.served import ServedModel
from llmpipe.observability import metrics
from llmpipe.parsing.streams import make_stream
from llmpipe.processors.inference_processor import PROMPT_TAIL, InferenceProcessor
from llmpipe.settings import Settings
from llmpipe.stages import Stage
from workers.engine_death import engine_died
from workers.launch import KINDS

log = logging.getLogger("llmpipe.worker")


def engine_running_slots(engine, s: Settings) -> int:
    """How many requests can run in the engine at once: its running set (vLLM's
    max_num_seqs) where known, else as many as this worker holds (one thread each), since
    vLLM's own default (256 and more on a GPU) is more than the worker ever hands it."""
    held = KINDS[Stage.INFERENCE].concurrency(s)
    seqs = getattr(engine, "max_num_seqs", None)
    return min(seqs, held) if seqs else held


@dataclass
class InferenceRuntime:
    """The processor and the two Redis companions it owns, shut down in this order."""

    processor: InferenceProcessor
    publisher: TokenPublisher
    cancel_listener: cancel.CancelListener

    def shutdown(self) -> None:
        self.cancel_listener.close()
        self.publisher.close()
        self.processor.shutdown()


def stream_parser(resources: Any):
    """(request, ids it already streamed) -> the ParsedStream of a streamed chat output for the
    model's parsers (llmpipe/parsing/streams.py); None when the model has none. The model's
    parsers are built here at start, so that a parser that cannot work with the tokenizer
    stops the worker naming the settings, as vllm serve refuses to start."""
    parser = resources.parser if resources is not None else None
    if parser is None:
        return None
    _ = parser.cls  # imports vLLM's parsers (this worker has vLLM imported already) and checks them

    def make(req: Any, prefix: list[int]) -> Any:
        return make_stream(parser.stream(req.parsing, req.prompt_token_ids), parser.tokenizer,
                           req.prompt_token_ids[-PROMPT_TAIL:], req.params.stop, Detokenizing.of(req.params), prefix)

    return make


def start_inference(engine: Any, r: redis.Redis, s: Settings, model: ServedModel, resources: Any = None, *,
                    own_queue: str | None = None, worker: str = "") -> InferenceRuntime:
    """The InferenceProcessor over ``engine`` for ``model``'s queue, its cancel listener,
    and a thread that samples the engine gauges until the processor stops. ``resources``: the
    model's tokenizer and parsers (workers/context.py ModelResources), for parsed streams.
    ``own_queue``: this worker's own queue (prefix-aware routing), where requests wait for it too;
    ``worker``: its node name, the label of its engine's prefix-cache counters."""

    def on_batch(size: int, wait_s: float) -> None:
        metrics.BATCH_SIZE.labels(model.name).observe(size)
        metrics.BATCH_WAIT.labels(model.name).observe(wait_s)

    publisher = TokenPublisher(r)
    queues = (model.queue, *([own_queue] if own_queue else []))
    try:
        proc = InferenceProcessor(
            engine, window_s=s.batch_window_ms / 1000.0, max_size=s.max_batch_size,
            company_expected=queue_probe(r, queues, s), on_batch=on_batch,
            # On AMQP both lanes share one queue: its depth is the only probe there.
            interactive_company=None if s.broker_is_amqp else queue_probe(r, queues, s, Lane.INTERACTIVE),
            publisher=publisher, cancelled_jobs=lambda ids: cancel.cancelled(r, ids),
            on_engine_dead=lambda exc: engine_died(exc, amqp=s.broker_is_amqp),
            published=lambda job_id: read_published(r, job_id), stream_parser=stream_parser(resources),
            batch_lane=lambda req: lane_for(req.priority, s.lane_batch_priority) is Lane.BATCH,
            batch_lane_slots=batch_lane_slots(s.lane_batch_slot_share, engine_running_slots(engine, s)),
            batch_lane_hold_s=s.lane_slot_hold_s, batch_lane_starting=s.lane_batch_starting,
        )
    except BaseException:
        publisher.close()
        raise
    listener = cancel.CancelListener(r, proc.cancel, proc.running_jobs)
    threading.Thread(target=sample_engine, args=(proc, model.name, worker), name="llmpipe-engine-stats",
                     daemon=True).start()
    return InferenceRuntime(proc, publisher, listener)


def sample_engine(proc: InferenceProcessor, model: str, worker: str = "", every_s: float = 1.0) -> None:
    """Engine gauges for the scrape, and the prefix cache's counters of this ``worker``; stops
    when the processor is shut down."""
    counted = {"prefix_cache_queries": 0.0, "prefix_cache_hits": 0.0}
    counters = {"prefix_cache_queries": metrics.PREFIX_CACHE_QUERIES, "prefix_cache_hits": metrics.PREFIX_CACHE_HITS}
    for counter in counters.values():  # a worker that has served nothing yet reads 0, not absent
        counter.labels(model, worker)
    while proc.batcher.running:
        try:
            st = proc.engine.stats()
            for name, counter in counters.items():  # the engine's totals, as counter increments
                if st.get(name, 0.0) > counted[name]:
                    counter.labels(model, worker).inc(st[name] - counted[name])
                    counted[name] = st[name]
            metrics.ENGINE_RUNNING.labels(model).set(st.get("running", 0))
            metrics.ENGINE_WAITING.labels(model).set(st.get("waiting", 0))
            if "kv_cache_usage" in st:
                metrics.ENGINE_KV.labels(model).set(st["kv_cache_usage"])
            metrics.BATCHER_PENDING.labels(model).set(proc.batcher.pending())
        except Exception:
            log.debug("engine stats failed", exc_info=True)
        time.sleep(every_s)


def queue_probe(r: redis.Redis, queue: str | tuple[str, ...], s: Settings | None = None, lane: Lane | None = None):
    """Company is expected while more requests (of ``lane``, when given: each has its lists on
    Redis) wait in the broker queue (any of ``queue``). On AMQP the lanes share one queue, whose
    depth counts both."""
    queues = (queue,) if isinstance(queue, str) else tuple(queue)
    if s is not None and s.broker_is_amqp:
        depths = AmqpDepths(s.effective_broker_url)
        return lambda: any(depths.sample(queues).depths.values())

    keys = [k for q in queues for k in queue_keys(q, lane)]  # the priority lists of each (llmpipe/jobs/lanes.py)

    def probe() -> bool:
        # Redis deletes a list when it empties, so "any list exists" is "a message waits":
        # one EXISTS over every lane instead of an LLEN per lane.
        return r.exists(*keys) > 0

    return probe
