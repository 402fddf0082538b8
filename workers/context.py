"""What a worker process owns, loaded lazily once per process, with a shutdown path.

Celery's worker_shutdown / worker_process_shutdown signals call ``shutdown_all``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from functools import cached_property

import redis

from llmpipe.broker.redis_clients import from_settings
from llmpipe.jobs.lanes import Lane, batch_lane_slots, lane_for, queue_keys
from llmpipe.jobs.store import JobStore
from llmpipe.settings import Settings, get_settings

log = logging.getLogger("llmpipe.worker")


def engine_running_slots(engine, s: Settings) -> int:
    """How many requests can run in the engine at once: its running set (vLLM's
    max_num_seqs) where known, else as many as this worker holds (one thread each), since
    vLLM's own default (256 and more on a GPU) is more than the worker ever hands it."""
    from workers.launch import KINDS

    held = KINDS["inference"].concurrency(s)
    seqs = getattr(engine, "max_num_seqs", None)
    return min(seqs, held) if seqs else held


class ModelResources:
    """One served model's tokenizer and CPU-stage processors in this process, each loaded
    once, on first use: a CPU worker serves every model and pays only for those it is asked for."""

    def __init__(self, settings: Settings, source: str):
        self.settings = settings
        self.source = source

    @cached_property
    def model_path(self) -> str:
        from llmpipe.models.registry import resolve_model

        return resolve_model(self.source, self.settings.models_dir)

    @cached_property
    def tokenizer_owner(self):
        from llmpipe.processors.tokenizer import TokenizerOwner

        return TokenizerOwner(self.model_path)

    @cached_property
    def context_len(self) -> int:
        from llmpipe.processors.tokenizer import model_context_length

        n = model_context_length(self.model_path) or 2048
        return min(n, self.settings.max_model_len) if self.settings.max_model_len else n

    @cached_property
    def input_processor(self):
        from llmpipe.processors.input_processor import InputProcessor
        from llmpipe.processors.tokenizer import model_vocab_size

        return InputProcessor(self.tokenizer_owner.get(), self.context_len, vocab_size=model_vocab_size(self.model_path))

    @cached_property
    def output_processor(self):
        from llmpipe.processors.output_processor import OutputProcessor

        return OutputProcessor(self.tokenizer_owner.get())

    def shutdown(self) -> None:
        if "tokenizer_owner" in self.__dict__:
            self.tokenizer_owner.shutdown()


WORKER_MODEL_ENV = "LLMPIPE_WORKER_MODEL"  # the model an inference worker serves (workers/pool_policy.py sets it)


class WorkerContext:
    def __init__(self, settings: Settings | None = None):
        self.settings = settings or get_settings()
        self._lock = threading.Lock()
        self._inference = None
        self._publisher = None
        self._cancel_listener = None
        self._models: dict[str, ModelResources] = {}
        self._models_lock = threading.Lock()  # not _lock: inference() holds that while it reads the model

    @property
    def served(self):
        return self.settings.served

    @property
    def own_model(self):
        """The model this process's engine runs: the one its inference queue names
        (LLMPIPE_WORKER_MODEL), else the default (first) one."""
        return self.served.get(os.environ.get(WORKER_MODEL_ENV) or None)

    def model(self, name: str | None = None) -> ModelResources:
        """``name``'s tokenizer and processors (None: the default model); unknown: ModelNotFoundError."""
        m = self.served.get(name)
        res = self._models.get(m.name)
        if res is None:
            with self._models_lock:
                res = self._models.setdefault(m.name, ModelResources(self.settings, m.source))
        return res

    # The own model's, for code that serves one model (the inference worker, the tests).
    @property
    def model_path(self) -> str:
        return self.model(self.own_model.name).model_path

    @property
    def tokenizer_owner(self):
        return self.model(self.own_model.name).tokenizer_owner

    @property
    def context_len(self) -> int:
        return self.model(self.own_model.name).context_len

    @property
    def input_processor(self):
        return self.model(self.own_model.name).input_processor

    @property
    def output_processor(self):
        return self.model(self.own_model.name).output_processor

    @cached_property
    def redis(self) -> redis.Redis:
        return from_settings(self.settings, socket_timeout=5, socket_connect_timeout=3, health_check_interval=30)

    @cached_property
    def jobs(self) -> JobStore:
        return JobStore(self.redis, self.settings.result_ttl_s)

    @cached_property
    def memo(self):
        """Stage results by request id, so a redelivered message re-runs nothing (llmpipe/jobs/memo.py)."""
        from llmpipe.jobs.memo import StageMemo

        s = self.settings
        # The memo outlives the latest redelivery: a dead lease's messages come back within
        # lease_ttl_s + sweep, and the visibility timeout (the last resort) bounds the rest.
        redelivery_s = max(s.lease_ttl_s + s.lease_sweep_interval_s,
                           s.effective_visibility_timeout_s + s.unacked_restore_interval_s)
        return StageMemo(self.redis, slack_s=redelivery_s + 60, max_deliveries=s.max_deliveries)

    @cached_property
    def deadletters(self):
        from llmpipe.jobs.deadletter import DeadLetters

        return DeadLetters(self.redis, ttl_s=self.settings.deadletter_ttl_s, max_entries=self.settings.deadletter_max_entries)

    @cached_property
    def engine_owner(self):
        from llmpipe.engines.factory import create_engine
        from llmpipe.engines.owner import EngineOwner
        from workers import hook

        return EngineOwner(lambda: hook.wrap_engine(create_engine(self.settings, self.model_path), self.settings,
                                                    self.model_path))

    def inference(self):
        """The process's InferenceProcessor (engine + batcher), built on first use."""
        if self._inference is None:
            with self._lock:
                if self._inference is None:
                    from llmpipe.jobs import cancel
                    from llmpipe.jobs.streaming import TokenPublisher, read_published
                    from llmpipe.observability import metrics
                    from llmpipe.processors.inference_processor import InferenceProcessor

                    engine = self.engine_owner.get()
                    s = self.settings

                    model = self.own_model

                    def on_batch(size: int, wait_s: float) -> None:
                        metrics.BATCH_SIZE.labels(model.name).observe(size)
                        metrics.BATCH_WAIT.labels(model.name).observe(wait_s)

                    self._publisher = TokenPublisher(self.redis)
                    proc = InferenceProcessor(
                        engine, window_s=s.batch_window_ms / 1000.0, max_size=s.max_batch_size,
                        company_expected=_queue_probe(self.redis, model.queue, s), on_batch=on_batch,
                        publisher=self._publisher, cancelled_jobs=lambda ids: cancel.cancelled(self.redis, ids),
                        on_engine_dead=engine_died, published=lambda job_id: read_published(self.redis, job_id),
                        batch_lane=lambda r: lane_for(r.priority, s.lane_batch_priority) is Lane.BATCH,
                        batch_lane_slots=batch_lane_slots(s.lane_batch_share, engine_running_slots(engine, s)),
                        batch_lane_hold_s=s.lane_slot_hold_s,
                    )
                    self._cancel_listener = cancel.CancelListener(self.redis, proc.cancel, proc.running_jobs)
                    threading.Thread(target=_sample_engine, args=(proc, model.name), name="llmpipe-engine-stats", daemon=True).start()
                    self._inference = proc
        return self._inference

    def shutdown_all(self) -> None:
        if self._cancel_listener is not None:
            self._cancel_listener.close()
            self._cancel_listener = None
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None
        if self._inference is not None:
            self._inference.shutdown()
            self._inference = None
        if "engine_owner" in self.__dict__:
            self.engine_owner.shutdown()
        for res in list(self._models.values()):
            res.shutdown()


def _sample_engine(proc, model: str, every_s: float = 1.0) -> None:
    """Engine gauges for the scrape; stops when the processor is shut down."""
    from llmpipe.observability import metrics

    while proc.batcher.running:
        try:
            st = proc.engine.stats()
            metrics.ENGINE_RUNNING.labels(model).set(st.get("running", 0))
            metrics.ENGINE_WAITING.labels(model).set(st.get("waiting", 0))
            if "kv_cache_usage" in st:
                metrics.ENGINE_KV.labels(model).set(st["kv_cache_usage"])
            metrics.BATCHER_PENDING.labels(model).set(proc.batcher.pending())
        except Exception:
            log.debug("engine stats failed", exc_info=True)
        time.sleep(every_s)


ENGINE_DEAD_EXIT = 70


def engine_died(exc: BaseException) -> None:
    """The engine is gone: hand this worker's messages back to the queue and exit non-zero.

    Every message this process took and did not ack (running, waiting for a thread, or
    done with its ack still pending) goes back to its queue at once, so another inference
    worker (or this one, restarted by its supervisor) takes them now instead of after the
    visibility timeout; one that had already finished replays its stored result
    (llmpipe/jobs/memo.py). Nothing waits on the dead engine, so the worker never hangs."""
    from celery.worker import state

    log.critical("engine died (%s: %s): requeueing this worker's messages and exiting with %d",
                 type(exc).__name__, exc, ENGINE_DEAD_EXIT)
    requeued = 0
    if context().settings.broker_is_amqp:
        # RabbitMQ returns every unacked message of this process to its queue when the
        # connection drops at exit: nothing to hand back by hand. Requests of earlier
        # batches that have their result store it first, so their redelivery replays it.
        time.sleep(0.2)
        print(f"llmpipe: engine died ({type(exc).__name__}: {exc}); this worker's messages are requeued by RabbitMQ; "
              f"exiting with {ENGINE_DEAD_EXIT}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(ENGINE_DEAD_EXIT)
    channels = {}
    for req in list(state.reserved_requests) + list(state.active_requests):
        ch = getattr(getattr(req, "message", None), "channel", None)
        if ch is not None:
            channels[id(ch)] = ch
    # Synchronously, on the consumer's channel: Request.reject only schedules the reject on
    # the consumer's event loop, which never runs again after os._exit. This is what kombu
    # does with unacked messages at a warm shutdown (QoS.restore_unacked), to the front of
    # the queue. First the channel stops fetching (can_consume() turns false), then a second
    # pass returns what a fetch already in flight brought in.
    done: set = set()
    try:
        for ch in channels.values():
            ch.qos.prefetch_count = 1
        # Requests of earlier batches that already have their result store and ack it now,
        # instead of running again after the requeue.
        time.sleep(0.2)
        for ch in list(channels.values()):
            # The lease transport (llmpipe/broker/redis_transport.py) gives back everything its lease
            # holds in one script, a claim whose reply is still unread included, and claims
            # nothing more.
            release = getattr(ch, "release_lease", None)
            if release is not None:
                requeued += release()
                del channels[id(ch)]
        for ch in channels.values():
            # A BRPOP already waiting on the server would take a requeued message straight
            # back into this dying process (and lose it): end it server-side first.
            conn = getattr(ch, "_in_poll", None)
            sock = getattr(conn, "_sock", None) if conn else None
            if sock is not None:
                host, port = sock.getsockname()[:2]
                with ch.conn_or_acquire() as client:
                    client.execute_command("CLIENT", "KILL", "ADDR", f"{host}:{port}")
        for _ in range(3):
            fresh = [(ch, t) for ch in channels.values() for t in list(ch.qos._delivered) if t not in done]
            for ch, tag in fresh:
                ch.qos.restore_by_tag(tag)
                done.add(tag)
            if not fresh and (done or not channels):
                break
            time.sleep(0.05)
        requeued += len(done)
    except Exception:  # the lease sweep (or the visibility timeout) brings them back anyway
        log.warning("could not requeue every message", exc_info=True)
    print(f"llmpipe: engine died ({type(exc).__name__}: {exc}); requeued {requeued} messages; exiting "
          f"with {ENGINE_DEAD_EXIT}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(ENGINE_DEAD_EXIT)


def _queue_probe(r: redis.Redis, queue: str, s: Settings | None = None):
    """Company is expected while more requests wait in the broker queue."""
    if s is not None and s.broker_is_amqp:
        from llmpipe.broker.queue_depth import AmqpDepths

        depths = AmqpDepths(s.effective_broker_url)
        return lambda: depths.sample((queue,)).depths[queue] > 0

    keys = queue_keys(queue)  # every priority list of the queue (llmpipe/jobs/lanes.py)

    def probe() -> bool:
        # Redis deletes a list when it empties, so "any list exists" is "a message waits":
        # one EXISTS over every lane instead of an LLEN per lane.
        return r.exists(*keys) > 0

    return probe


_context: WorkerContext | None = None
_context_lock = threading.Lock()


def context() -> WorkerContext:
    global _context
    if _context is None:
        with _context_lock:
            if _context is None:
                _context = WorkerContext()
    return _context


def reset_context() -> None:
    global _context
    if _context is not None:
        _context.shutdown_all()
    _context = None
