"""Wakes HTTP requests that wait for a job to finish, with one shared pub/sub connection.

Celery's Redis backend PUBLISHes every stored result on the result key's channel; the job
store publishes terminal transitions (cancelled, expired) on its own channel. A waiter
subscribes before it reads the job, so a result that lands in between is never missed,
and unsubscribes when it is done, so no subscription outlives its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import AsyncIterator

import redis.asyncio as aioredis

from llmpipe.jobs import done_channel

log = logging.getLogger("llmpipe.api")


def result_channel(job_id: str) -> str:
    return f"celery-task-meta-{job_id}"


class JobWaiter:
    def __init__(self, redis_url: str):
        self._url = redis_url
        self._redis: aioredis.Redis | None = None
        self._pubsub = None
        self._events: dict[str, set[asyncio.Event]] = defaultdict(set)
        self._reader: asyncio.Task | None = None
        self._lock = asyncio.Lock()

    async def _ensure(self) -> None:
        if self._pubsub is None:
            self._redis = aioredis.Redis.from_url(self._url, socket_connect_timeout=2)
            self._pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            # A placeholder channel keeps the connection in subscribed mode.
            await self._pubsub.subscribe("llmpipe:waiter")
            self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self._pubsub is not None
        while True:
            try:
                msg = await self._pubsub.get_message(timeout=1.0)
            except asyncio.CancelledError:
                raise
            except Exception:  # redis went away: wake everyone; they re-read and report
                log.warning("job waiter lost its redis connection", exc_info=True)
                for evs in self._events.values():
                    for ev in evs:
                        ev.set()
                await asyncio.sleep(0.5)
                continue
            if msg and msg.get("type") == "message":
                ch = msg["channel"].decode() if isinstance(msg["channel"], bytes) else msg["channel"]
                for ev in self._events.get(ch, ()):
                    ev.set()

    @contextlib.asynccontextmanager
    async def watch(self, job_id: str) -> AsyncIterator[asyncio.Event]:
        ev = asyncio.Event()
        channels = [result_channel(job_id), done_channel(job_id)]
        async with self._lock:
            await self._ensure()
            new = [c for c in channels if not self._events.get(c)]
            for c in channels:
                self._events[c].add(ev)
            if new:
                await self._pubsub.subscribe(*new)
        try:
            yield ev
        finally:
            async with self._lock:
                gone = []
                for c in channels:
                    self._events[c].discard(ev)
                    if not self._events[c]:
                        del self._events[c]
                        gone.append(c)
                if gone and self._pubsub is not None:
                    with contextlib.suppress(Exception):
                        await self._pubsub.unsubscribe(*gone)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(BaseException):
                await self._reader
        if self._pubsub is not None:
            with contextlib.suppress(Exception):
                await self._pubsub.aclose()
        if self._redis is not None:
            with contextlib.suppress(Exception):
                await self._redis.aclose()
