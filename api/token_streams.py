"""One reader of every job token stream that this API process streams to its clients.

A streamed response follows its job's token stream (llmpipe/jobs/streaming.py). With an
XREAD of its own, every open stream held a connection of the API's asyncio pool, which
redis-py caps at 100: the 101st concurrent stream's read failed ("Too many connections")
and its client got a cut stream. Here one task blocks on one XREAD over every followed
stream, on one connection, so a step's entries, which the inference worker writes in one
pipeline, come back in one or two replies (on the simulated engine at 64 streams, half the
XREADs; the API's CPU per request stayed within the spread).

A stream followed while that XREAD is out joins the next one: :meth:`TokenStreams.follow`
asks a waker task to append to this process's wake stream, which the XREAD also reads, so
it returns at once.
Each follower keeps its own position, and the streams stay in Redis (``STREAM_TTL_S``), so a
lost connection costs nothing but time: the reader reconnects with backoff and every
follower resumes where it was. Followers are woken meanwhile, with nothing, so that their
responses read the job's record as they do when a stream stays silent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from api.aio import within
from llmpipe.broker.redis_clients import DEFAULT_MASTER, aconnect
from llmpipe.jobs.streaming import stream_key

log = logging.getLogger("llmpipe.api")

WAKE_PREFIX = "llmpipe:tokens-wake:"
READER_NAME = "llmpipe-token-streams"  # the reader connection's CLIENT SETNAME
_WAKE_TTL_S = 3600  # a wake stream outlives its API process by this long at most
_START = b"0-0"

Entry = tuple[bytes, dict]


def _position(entry_id: bytes) -> tuple[int, int]:
    ms, _, seq = entry_id.partition(b"-")
    return int(ms), int(seq or 0)


class Follower:
    """What one response has of its job's stream: the entries since its last :meth:`next`."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.last = _START  # the id of the last entry delivered
        self._entries: list[Entry] = []
        self._ready = asyncio.Event()

    def deliver(self, entries: list[Entry]) -> None:
        last = _position(self.last)
        fresh = [e for e in entries if _position(e[0]) > last]
        if fresh:
            self._entries.extend(fresh)
            self.last = fresh[-1][0]
            self._ready.set()

    def wake(self) -> None:
        """Ends a wait with nothing: its response reads the job's record."""
        self._ready.set()

    async def next(self, timeout: float) -> list[Entry]:
        """The entries that came since the last call, waiting up to ``timeout`` seconds for
        one; [] when none came (or the reader lost its connection meanwhile)."""
        if not self._entries:
            await within(self._ready.wait(), timeout)
        self._ready.clear()
        out, self._entries = self._entries, []
        return out


class TokenStreams:
    """``commands``: the client for the wake appends and :meth:`rest`, which ``close`` closes;
    the blocking XREAD has a connection of its own, made from ``redis_url``."""

    def __init__(self, redis_url: str, commands: aioredis.Redis, *, master_name: str = DEFAULT_MASTER,
                 block_ms: int = 1000, count: int = 256, backoff_max_s: float = 1.0) -> None:
        self._url = redis_url
        self._master_name = master_name
        self._commands = commands
        self.block_ms = block_ms
        self.count = count
        self.backoff_max_s = backoff_max_s
        self.wake_key = f"{WAKE_PREFIX}{uuid.uuid4().hex}".encode()
        self._wake_last = _START
        self._followers: dict[bytes, set[Follower]] = {}
        self._work = asyncio.Event()  # set by follow: the reader idles while nothing is followed
        self._reading = False  # an XREAD is out: a new follower must wake it
        self._wake_wanted = asyncio.Event()  # a follower came: one task appends to the wake stream
        self._reader: asyncio.Task | None = None
        self._waker: asyncio.Task | None = None
        self.reconnects = 0

    @property
    def following(self) -> int:
        """Followers registered (a test checks that none leaks)."""
        return sum(len(fs) for fs in self._followers.values())

    @contextlib.asynccontextmanager
    async def follow(self, job_id: str) -> AsyncIterator[Follower]:
        f = Follower(stream_key(job_id).encode())
        self._followers.setdefault(f.key, set()).add(f)
        try:
            if self._reader is None or self._reader.done():
                self._reader = asyncio.create_task(self._run(), name="llmpipe-token-streams")
                self._waker = asyncio.create_task(self._wake_loop(), name="llmpipe-token-streams-waker")
            self._work.set()
            self._wake_wanted.set()
            yield f
        finally:
            fs = self._followers.get(f.key)
            if fs is not None:
                fs.discard(f)
                if not fs:
                    del self._followers[f.key]

    async def rest(self, f: Follower) -> list[Entry]:
        """What the follower's stream holds beyond what it was given, read now, without waiting."""
        resp = await self._commands.xread({f.key: f.last})
        f.deliver([e for _, es in _items(resp) for e in es])
        return await f.next(0)

    async def _wake_loop(self) -> None:
        # One append at a time, however many streams open at once: each wakes the XREAD that
        # is out, and the next XREAD reads every stream followed by then. A follower that came
        # after the flag was cleared sets it again, so none is left waiting on an old XREAD.
        while True:
            await self._wake_wanted.wait()
            self._wake_wanted.clear()
            if self._reading:
                await self._wake()

    async def _wake(self) -> None:
        try:
            pipe = self._commands.pipeline(transaction=False)
            pipe.xadd(self.wake_key, {"w": 1}, maxlen=8, approximate=False)
            pipe.expire(self.wake_key, _WAKE_TTL_S)
            await pipe.execute()
        except Exception as exc:  # the reader's own read fails too, and reconnects with them all
            log.debug("could not wake the token stream reader: %s", exc)

    async def _run(self) -> None:
        delay = 0.05
        while True:
            client = None
            try:
                client = aconnect(self._url, self._master_name, socket_connect_timeout=2, socket_keepalive=True,
                                  retry=Retry(NoBackoff(), 0), client_name=READER_NAME)
                self.reconnects += 1
                await self._read(client)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("token streams: redis connection lost (%s: %s); reconnecting", type(exc).__name__, exc)
            finally:
                if client is not None:
                    with contextlib.suppress(Exception):
                        await client.aclose()
            self._wake_all()  # they read their job's record meanwhile, as when a stream stays silent
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.backoff_max_s)

    async def _read(self, client: aioredis.Redis) -> None:
        me = asyncio.current_task()
        while True:
            if not self._followers:
                self._work.clear()
                await self._work.wait()
                continue
            streams = {self.wake_key: self._wake_last}
            for key, fs in self._followers.items():
                streams[key] = min((f.last for f in fs), key=_position)
            self._reading = True
            try:
                resp = await client.xread(streams, count=self.count, block=self.block_ms)
            finally:
                self._reading = False
            if me is not None and me.cancelling():
                raise asyncio.CancelledError  # (as api/waiter.py: a cancel redis-py's read may have swallowed)
            for key, entries in _items(resp):
                if key == self.wake_key:
                    self._wake_last = entries[-1][0]
                    continue
                for f in list(self._followers.get(key, ())):
                    f.deliver(entries)

    def _wake_all(self) -> None:
        for fs in self._followers.values():
            for f in fs:
                f.wake()

    async def close(self) -> None:
        waker, self._waker = self._waker, None
        if waker is not None:
            waker.cancel()  # it waits on an event or on one append: it ends at the cancel
            await asyncio.wait({waker}, timeout=1.0)
        reader, self._reader = self._reader, None
        while reader is not None and not reader.done():
            reader.cancel()  # again until it ends (see _read)
            await asyncio.wait({reader}, timeout=1.0)
        with contextlib.suppress(Exception):
            await self._commands.delete(self.wake_key)
        await self._commands.aclose()


def _items(resp) -> list[tuple[bytes, list[Entry]]]:
    """XREAD's reply as (key, entries) pairs: a list of them (RESP2) or a dict (RESP3)."""
    if not resp:
        return []
    if isinstance(resp, dict):
        return [(k, v[0] if v and isinstance(v[0], list) else v) for k, v in resp.items()]
    return [(k, v) for k, v in resp]
