"""The engine is gone: hand this worker's messages back to the queue and exit non-zero.

Every message this process took and did not ack (running, waiting for a thread, or done
with its ack still pending) goes back to its queue at once, so another inference worker
(or this one, restarted by its supervisor) takes them now instead of after the visibility
timeout; one that had already finished replays its stored result (llmpipe/jobs/memo.py).
Nothing waits on the dead engine, so the worker never hangs.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from celery.worker import state

log = logging.getLogger("llmpipe.worker")

ENGINE_DEAD_EXIT = 70


def engine_died(exc: BaseException, *, amqp: bool) -> None:
    """The InferenceProcessor's ``on_engine_dead``; ``amqp``: the broker is RabbitMQ."""
    log.critical("engine died (%s: %s): requeueing this worker's messages and exiting with %d",
                 type(exc).__name__, exc, ENGINE_DEAD_EXIT)
    if amqp:
        # RabbitMQ returns every unacked message of this process to its queue when the
        # connection drops at exit: nothing to hand back by hand. Requests of earlier
        # batches that have their result store it first, so their redelivery replays it.
        time.sleep(0.2)
        _exit(exc, "this worker's messages are requeued by RabbitMQ")
    back = _HandBack(_consumer_channels())
    try:
        back.run()
    except Exception:  # the lease sweep (or the visibility timeout) brings them back anyway
        log.warning("could not requeue every message", exc_info=True)
    _exit(exc, f"requeued {back.requeued} messages")


def _exit(exc: BaseException, what: str) -> None:
    print(f"llmpipe: engine died ({type(exc).__name__}: {exc}); {what}; exiting with {ENGINE_DEAD_EXIT}",
          file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(ENGINE_DEAD_EXIT)


def _consumer_channels() -> dict:
    """The channels of every message this process holds, by id."""
    channels = {}
    for req in list(state.reserved_requests) + list(state.active_requests):
        ch = getattr(getattr(req, "message", None), "channel", None)
        if ch is not None:
            channels[id(ch)] = ch
    return channels


class _HandBack:
    """Requeues, synchronously, on the consumer's channels, what this process holds.

    Synchronously: Request.reject only schedules the reject on the consumer's event loop,
    which never runs again after os._exit. This is what kombu does with unacked messages at
    a warm shutdown (QoS.restore_unacked), to the front of the queue. First the channel
    stops fetching (can_consume() turns false), then a second pass returns what a fetch
    already in flight brought in. ``requeued`` counts what went back, also when a step fails."""

    def __init__(self, channels: dict):
        self.channels = channels
        self.requeued = 0

    def run(self) -> None:
        for ch in self.channels.values():
            ch.qos.prefetch_count = 1
        # Requests of earlier batches that already have their result store and ack it now,
        # instead of running again after the requeue.
        time.sleep(0.2)
        for ch in list(self.channels.values()):
            # The lease transport (llmpipe/broker/redis_transport.py) gives back everything its
            # lease holds in one script, a claim whose reply is still unread included, and
            # claims nothing more.
            release = getattr(ch, "release_lease", None)
            if release is not None:
                self.requeued += release()
                del self.channels[id(ch)]
        for ch in self.channels.values():
            _end_blocking_pop(ch)
        self.requeued += _restore_delivered(self.channels)


def _end_blocking_pop(ch) -> None:
    """A BRPOP already waiting on the server would take a requeued message straight back
    into this dying process (and lose it): end it server-side first."""
    conn = getattr(ch, "_in_poll", None)
    sock = getattr(conn, "_sock", None) if conn else None
    if sock is not None:
        host, port = sock.getsockname()[:2]
        with ch.conn_or_acquire() as client:
            client.execute_command("CLIENT", "KILL", "ADDR", f"{host}:{port}")


def _restore_delivered(channels: dict) -> int:
    """kombu's Redis channels without a lease: restore each delivered, unacked message."""
    done: set = set()
    for _ in range(3):
        fresh = [(ch, t) for ch in channels.values() for t in list(ch.qos._delivered) if t not in done]
        for ch, tag in fresh:
            ch.qos.restore_by_tag(tag)
            done.add(tag)
        if not fresh and (done or not channels):
            break
        time.sleep(0.05)
    return len(done)
