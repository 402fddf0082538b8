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

from llmpipe.jobs import JobStore
from llmpipe.settings import Settings, get_settings

log = logging.getLogger("llmpipe.worker")


class WorkerContext:
    def __init__(self, settings: Settings | None = None):
        self.settings = settings or get_settings()
        self._lock = threading.Lock()
        self._inference = None
        self._publisher = None
        self._cancel_listener = None

    @cached_property
    def model_path(self) -> str:
        from llmpipe.models.registry import resolve_model

        return resolve_model(self.settings.model, self.settings.models_dir)

    @cached_property
    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.settings.redis_url, socket_timeout=5, socket_connect_timeout=3,
                                    health_check_interval=30)

    @cached_property
    def jobs(self) -> JobStore:
        return JobStore(self.redis, self.settings.result_ttl_s)

    @cached_property
    def memo(self):
        """Stage results by request id, so a redelivered message re-runs nothing (llmpipe/idempotency.py)."""
        from llmpipe.idempotency import StageMemo

        s = self.settings
        return StageMemo(self.redis, slack_s=s.effective_visibility_timeout_s + s.unacked_restore_interval_s + 60,
                         max_deliveries=s.max_deliveries)

    @cached_property
    def deadletters(self):
        from llmpipe.deadletter import DeadLetters

        return DeadLetters(self.redis, ttl_s=self.settings.deadletter_ttl_s, max_entries=self.settings.deadletter_max_entries)

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

    @cached_property
    def engine_owner(self):
        from llmpipe.engines.factory import create_engine
        from llmpipe.engines.owner import EngineOwner

        return EngineOwner(lambda: create_engine(self.settings, self.model_path))

    def inference(self):
        """The process's InferenceProcessor (engine + batcher), built on first use."""
        if self._inference is None:
            with self._lock:
                if self._inference is None:
                    from llmpipe.processors.inference_processor import InferenceProcessor

                    from llmpipe import cancel, metrics
                    from llmpipe.streaming import TokenPublisher, read_published

                    engine = self.engine_owner.get()
                    s = self.settings

                    def on_batch(size: int, wait_s: float) -> None:
                        metrics.BATCH_SIZE.observe(size)
                        metrics.BATCH_WAIT.observe(wait_s)

                    self._publisher = TokenPublisher(self.redis)
                    proc = InferenceProcessor(
                        engine, window_s=s.batch_window_ms / 1000.0, max_size=s.max_batch_size,
                        company_expected=_queue_probe(self.redis, "inference"), on_batch=on_batch,
                        publisher=self._publisher, cancelled_jobs=lambda ids: cancel.cancelled(self.redis, ids),
                        on_engine_dead=engine_died, published=lambda job_id: read_published(self.redis, job_id),
                    )
                    self._cancel_listener = cancel.CancelListener(self.redis, proc.cancel)
                    threading.Thread(target=_sample_engine, args=(proc,), name="llmpipe-engine-stats", daemon=True).start()
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
        if "tokenizer_owner" in self.__dict__:
            self.tokenizer_owner.shutdown()


def _sample_engine(proc, every_s: float = 1.0) -> None:
    """Engine gauges for the scrape; stops when the processor is shut down."""
    from llmpipe import metrics

    while proc.batcher.running:
        try:
            st = proc.engine.stats()
            metrics.ENGINE_RUNNING.set(st.get("running", 0))
            metrics.ENGINE_WAITING.set(st.get("waiting", 0))
            if "kv_cache_usage" in st:
                metrics.ENGINE_KV.set(st["kv_cache_usage"])
            metrics.BATCHER_PENDING.set(proc.batcher.pending())
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
    (llmpipe/idempotency.py). Nothing waits on the dead engine, so the worker never hangs."""
    from celery.worker import state

    log.critical("engine died (%s: %s): requeueing this worker's messages and exiting with %d",
                 type(exc).__name__, exc, ENGINE_DEAD_EXIT)
    requeued = 0
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
            if not fresh and done:
                break
            time.sleep(0.05)
        requeued = len(done)
    except Exception:  # the visibility timeout brings them back anyway
        log.warning("could not requeue every message", exc_info=True)
    print(f"llmpipe: engine died ({type(exc).__name__}: {exc}); requeued {requeued} messages; exiting "
          f"with {ENGINE_DEAD_EXIT}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(ENGINE_DEAD_EXIT)


def _queue_probe(r: redis.Redis, queue: str):
    """Company is expected while more requests wait in the broker queue."""

    def probe() -> bool:
        return r.llen(queue) > 0

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
