"""Wakes HTTP requests that wait for a job to end, with one shared pub/sub connection.

Every terminal move of a job record is PUBLISHed on the job's done channel, and the message
is the move itself (llmpipe/jobs/store.py). The connection holds one pattern subscription to every
job's done channel, made once per connection, so waiting on a job costs Redis nothing: a
request that waits (``?wait=``, a non-streaming OpenAI call, an SSE stream) registers in
this process with :meth:`JobWaiter.watch` and gets a :class:`Wake`, reads the record, and
when woken takes the ended state from the message (``Wake.payload``) or reads the record
again, until the job has ended or it stops waiting. A wake without a message (a reconnect)
is a hint to read again, never a state: a spurious wake costs one read.

The price of one subscription for every job: each API process receives the end of every
job, its own or not (a message of a few hundred bytes to a few KiB; a result longer than
``WAKE_RESULT_MAX`` is not carried). Against it, a wait no longer costs a SUBSCRIBE and an
UNSUBSCRIBE, nor the round trip of waiting for the subscription before the first read
(docs/benchmarks.md).

The connection is owned by one reader task that never gives up: on any error it drops the
connection, wakes every watcher, and reconnects with backoff, subscribing again. As the
subscription is confirmed it wakes the watchers once more, since a job may have ended while
nothing listened. So a Redis outage, even one before the first request ever waited, costs
no wake-up afterwards; and a watcher that registers while Redis is down is not left behind:
its record read fails (503) and its registration is removed on the way out.

A watcher's first read happens after the subscription is confirmed by Redis (or after
``confirm_timeout_s``, when the reader is reconnecting and will wake it), and after the
watcher is registered, so a result that lands before the read is in the record and one that
lands after it wakes the watcher. Other channels (the Celery result key of a task the API
waits for, ``POST /tokenize``) are subscribed one by one, for as long as they have watchers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import anyio
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from api.aio import within
from llmpipe.broker.redis_clients import DEFAULT_MASTER, aconnect
from llmpipe.jobs.store import DONE_PATTERN, DONE_PREFIX, done_channel

log = logging.getLogger("llmpipe.api")

PLACEHOLDER = "llmpipe:waiter"  # keeps the connection in subscribed mode with no watcher


class Wake(asyncio.Event):
    """A watcher's event. ``payload``: the data of the last message on its channel (None
    until one came); a wake by a reconnect sets the event and leaves it as it was."""

    def __init__(self) -> None:
        super().__init__()
        self.payload: bytes | None = None


class JobWaiter:
    def __init__(self, redis_url: str, *, master_name: str = DEFAULT_MASTER, confirm_timeout_s: float = 2.0,
                 backoff_max_s: float = 1.0):
        self._url = redis_url
        self._master_name = master_name
        self.confirm_timeout_s = confirm_timeout_s
        self.backoff_max_s = backoff_max_s
        self._watchers: dict[str, set[Wake]] = {}
        self._pubsub = None  # the live subscribed connection, or None while (re)connecting
        self._client: aioredis.Redis | None = None
        # channel (or DONE_PATTERN) -> its SUBSCRIBE (PSUBSCRIBE) is confirmed
        self._confirmed: dict[str, asyncio.Future] = {}
        self._unconfirmed: dict[str, int] = {}  # channel -> SUBSCRIBEs sent, not yet confirmed
        self._reader: asyncio.Task | None = None
        self.reconnects = 0

    @property
    def watching(self) -> int:
        """Registered watchers (a test checks that none leaks)."""
        return sum(len(evs) for evs in self._watchers.values())

    def watchers(self, job_id: str) -> int:
        """Requests of this process that wait on the job (tests wait for them)."""
        return len(self._watchers.get(done_channel(job_id), ()))

    @property
    def listening(self) -> bool:
        """The connection is up and its subscription to every job's end is confirmed."""
        fut = self._confirmed.get(DONE_PATTERN)
        return self._pubsub is not None and fut is not None and fut.done() and bool(fut.result())

    def watch(self, job_id: str) -> contextlib.AbstractAsyncContextManager[Wake]:
        """Woken by every terminal move of the job's record; the wake carries the move."""
        return self.watch_channel(done_channel(job_id))

    @contextlib.asynccontextmanager
    async def watch_channel(self, ch: str) -> AsyncIterator[Wake]:
        """Woken by a PUBLISH on ``ch``: a job's done channel, or the Celery result key of a
        task the API waits for (``POST /tokenize``, api/vllm/service.py)."""
        ev = Wake()
        self._watchers.setdefault(ch, set()).add(ev)
        try:
            if self._reader is None or self._reader.done():
                self._reader = asyncio.create_task(self._run(), name="llmpipe-job-waiter")
            await self._subscribed(ch)
            ev.clear()  # the confirmation woke it; the caller reads the record next anyway
            yield ev
        finally:
            evs = self._watchers.get(ch)
            if evs is not None:
                evs.discard(ev)
                if not evs:
                    del self._watchers[ch]
                    if not _is_done(ch):
                        # Shielded: a watch ended by cancellation (a client that went away)
                        # must still unsubscribe.
                        with anyio.move_on_after(2, shield=True):
                            await self._unsubscribe(ch)

    # -- subscriptions ---------------------------------------------------------------------
    async def _subscribed(self, ch: str) -> None:
        """Until ``ch`` is subscribed on the live connection, best effort and bounded. When
        there is none, the reader subscribes it on reconnect and wakes its watchers."""
        done = _is_done(ch)
        fut = self._confirmed.get(DONE_PATTERN if done else ch)
        if fut is None:
            ps = self._pubsub
            if ps is None or done:  # (the pattern comes with the connection: none is up yet)
                return
            fut = self._confirmed[ch] = asyncio.get_running_loop().create_future()
            self._unconfirmed[ch] = self._unconfirmed.get(ch, 0) + 1
            try:
                await ps.subscribe(ch)
            except Exception as exc:  # the connection broke: the reader notices and reconnects
                log.debug("subscribe %s failed: %s", ch, exc)
                return
        if fut.done():  # the common case: the connection's subscription is long confirmed
            return
        await within(asyncio.shield(fut), self.confirm_timeout_s)

    async def _unsubscribe(self, ch: str) -> None:
        self._confirmed.pop(ch, None)
        ps = self._pubsub
        if ps is not None:
            with contextlib.suppress(Exception):  # a broken connection drops it anyway
                await ps.unsubscribe(ch)

    def _wake(self, ch: str, payload: bytes | None = None) -> None:
        for ev in self._watchers.get(ch, ()):
            if payload is not None:
                ev.payload = payload
            ev.set()

    def _wake_all(self) -> None:
        for ch in list(self._watchers):
            self._wake(ch)

    # -- the reader --------------------------------------------------------------------------
    async def _run(self) -> None:
        delay = 0.05
        while True:
            try:
                await self._connect()
                delay = 0.05
                await self._read()
            except asyncio.CancelledError:
                await self._drop()
                raise
            except Exception as exc:
                log.warning("job waiter: redis connection lost (%s: %s); reconnecting", type(exc).__name__, exc)
            await self._drop()
            self._wake_all()  # they read the record again: its state, or a 503 while Redis is down
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.backoff_max_s)

    async def _connect(self) -> None:
        # No retries inside redis-py: an error must reach _run, which resubscribes everything.
        client = aconnect(self._url, self._master_name, socket_connect_timeout=2, socket_keepalive=True,
                          retry=Retry(NoBackoff(), 0))
        ps = client.pubsub()
        try:
            channels = [PLACEHOLDER, *(ch for ch in self._watchers if not _is_done(ch))]
            loop = asyncio.get_running_loop()
            for ch in channels:
                self._confirmed[ch] = loop.create_future()
                self._unconfirmed[ch] = 1
            self._confirmed[DONE_PATTERN] = loop.create_future()
            await ps.psubscribe(DONE_PATTERN)
            await ps.subscribe(*channels)
        except BaseException:
            with contextlib.suppress(Exception):
                await ps.aclose()
            with contextlib.suppress(Exception):
                await client.aclose()
            raise
        self._client, self._pubsub = client, ps
        self.reconnects += 1
        # Watchers that came or went while SUBSCRIBE was on its way (later ones do it themselves).
        missing = [ch for ch in self._watchers if ch not in self._confirmed and not _is_done(ch)]
        stale = [ch for ch in channels[1:] if ch not in self._watchers]
        for ch in missing:
            self._confirmed[ch] = loop.create_future()
            self._unconfirmed[ch] = self._unconfirmed.get(ch, 0) + 1
        for ch in stale:
            self._confirmed.pop(ch, None)
        if missing:
            await ps.subscribe(*missing)
        if stale:
            await ps.unsubscribe(*stale)

    async def _read(self) -> None:
        ps = self._pubsub
        me = asyncio.current_task()
        while True:
            msg = await ps.get_message(timeout=1.0)
            if me is not None and me.cancelling():
                # Python 3.11's asyncio.timeout (inside redis-py's read) turns a cancel that lands
                # as the read times out into its own TimeoutError: get_message returns None and
                # the cancel is lost, so close() would wait forever.
                raise asyncio.CancelledError
            if not msg:
                continue
            kind = msg.get("type")
            ch = msg["channel"].decode() if isinstance(msg["channel"], bytes) else msg["channel"]
            if kind in ("pmessage", "message"):
                self._wake(ch, msg.get("data"))
            elif kind == "psubscribe":
                fut = self._confirmed.get(ch)
                if fut is not None and not fut.done():
                    fut.set_result(True)
                for job_ch in [c for c in self._watchers if _is_done(c)]:
                    self._wake(job_ch)  # a job may have ended while nothing listened
            elif kind == "subscribe":
                left = self._unconfirmed.get(ch, 0) - 1
                if left > 0:
                    self._unconfirmed[ch] = left
                    continue
                self._unconfirmed.pop(ch, None)
                fut = self._confirmed.get(ch)
                if fut is not None and not fut.done():
                    fut.set_result(True)
                self._wake(ch)  # a job may have ended while this channel was not subscribed

    async def _drop(self) -> None:
        ps, client = self._pubsub, self._client
        self._pubsub = self._client = None
        for fut in self._confirmed.values():
            if not fut.done():
                fut.set_result(False)
        self._confirmed.clear()
        self._unconfirmed.clear()
        if ps is not None:
            with contextlib.suppress(Exception):
                await ps.aclose()
        if client is not None:
            with contextlib.suppress(Exception):
                await client.aclose()

    async def close(self) -> None:
        reader, self._reader = self._reader, None
        while reader is not None and not reader.done():
            # Again until it ends: a cancel that lands inside redis-py's read timeout can be
            # lost (see _read), and close() must not wait on the reader forever.
            reader.cancel()
            await asyncio.wait({reader}, timeout=1.0)
        await self._drop()


def _is_done(ch: str) -> bool:
    return ch.startswith(DONE_PREFIX)
