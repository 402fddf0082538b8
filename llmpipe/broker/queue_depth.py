"""How many messages wait in each stage queue, on whichever broker holds them.

On Redis a queue is a list per priority step (LLEN each, one pipelined round trip). On RabbitMQ a passive
``queue.declare`` answers the queue's ready message count; both count messages no worker
holds yet (delivered, unacked ones are not counted on either). RabbitMQ reads cost a round
trip per queue, so they are cached for ``max_age_s``: readers are admission (per job), the
inference batcher's "is more coming?" probe, and the ``/metrics`` scrape. Admission keeps
the cache short (the API uses 50 ms): between samples it counts each newly published job
as queued, even one a worker took at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from llmpipe.jobs.lanes import PRIORITY_STEPS, queue_keys

log = logging.getLogger(__name__)

AMQP_SCHEMES = ("amqp", "amqps", "pyamqp")


def is_amqp(url: str) -> bool:
    return urlsplit(url).scheme.split("+")[0] in AMQP_SCHEMES


@dataclass(frozen=True)
class DepthSample:
    depths: dict[str, int]
    taken_at: float  # on the reader's clock (epoch seconds by default: admission compares it to its own)
    extra: dict[str, Any] = field(default_factory=dict)


class RedisDepths:
    """LLEN of each queue's lists (one per priority step, llmpipe/jobs/lanes.py), read fresh each time."""

    def __init__(self, r: Any, clock: Callable[[], float] = time.time):
        self.r = r
        self._clock = clock

    def sample(self, queues: Iterable[str], fresh: bool = False) -> DepthSample:
        queues = tuple(queues)
        pipe = self.r.pipeline(transaction=False)
        for q in queues:
            for key in queue_keys(q):
                pipe.llen(key)
        counts = [int(d) for d in pipe.execute()]
        per = len(PRIORITY_STEPS)
        return DepthSample({q: sum(counts[i * per:(i + 1) * per]) for i, q in enumerate(queues)}, self._clock())

    def close(self) -> None:
        pass


class AmqpDepths:
    """RabbitMQ's ready message count per queue (passive ``queue.declare``), cached.

    ``clock`` stamps each sample and ages the cache; it is wall time by default because
    admission compares the stamp with the epoch times at which jobs were published. A queue
    that does not exist yet (no worker or publisher declared it) holds nothing: 0. One
    connection per reader, made on first use and again after any error; the lock makes
    concurrent callers (the API's threadpool) share one refresh."""

    def __init__(self, url: str, *, max_age_s: float = 0.25, connect_timeout_s: float = 2.0,
                 clock: Callable[[], float] = time.time, connection_factory: Callable[[], Any] | None = None):
        self.url = url
        self.max_age_s = max_age_s
        self.connect_timeout_s = connect_timeout_s
        self._clock = clock
        self._factory = connection_factory or self._connect
        self._conn: Any = None
        self._channel: Any = None
        self._cache: DepthSample | None = None
        self._lock = threading.Lock()

    def _connect(self) -> Any:
        from kombu import Connection

        conn = Connection(self.url, connect_timeout=self.connect_timeout_s,
                          transport_options={"read_timeout": self.connect_timeout_s, "write_timeout": self.connect_timeout_s})
        conn.ensure_connection(max_retries=1)
        return conn

    def _count(self, queue: str) -> int:
        from amqp.exceptions import NotFound

        if self._conn is None:
            self._conn = self._factory()
        if self._channel is None:
            self._channel = self._conn.channel()
        try:
            return int(self._channel.queue_declare(queue=queue, passive=True).message_count)
        except NotFound:  # the broker closed this channel; the next read opens another
            self._channel = None
            return 0

    def sample(self, queues: Iterable[str], now: float | None = None, fresh: bool = False) -> DepthSample:
        """The depths of ``queues``, from the cache unless it is older than ``max_age_s`` or
        ``fresh`` asks for the broker's count now."""
        queues = tuple(queues)
        with self._lock:
            if now is None:
                now = self._clock()
            cached = self._cache
            if (not fresh and cached is not None and now - cached.taken_at < self.max_age_s
                    and set(queues) <= cached.depths.keys()):
                return DepthSample({q: cached.depths[q] for q in queues}, cached.taken_at)
            try:
                depths = {q: self._count(q) for q in queues}
            except Exception:
                self._drop()
                raise
            # Stamped before the reads' answers count as "now": a message published after
            # this moment may be missing from the counts (admission adds those itself).
            self._cache = DepthSample(depths, now)
            return self._cache

    def _drop(self) -> None:
        conn, self._conn, self._channel, self._cache = self._conn, None, None, None
        if conn is not None:
            try:
                conn.release()
            except Exception:
                log.debug("closing the queue-depth connection failed", exc_info=True)

    def close(self) -> None:
        with self._lock:
            self._drop()


def depth_reader(broker_url: str, r: Any, **amqp_kw) -> RedisDepths | AmqpDepths:
    """The reader for the configured broker: Redis lists, or RabbitMQ queues."""
    return AmqpDepths(broker_url, **amqp_kw) if is_amqp(broker_url) else RedisDepths(r)
