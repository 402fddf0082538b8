"""The API's one reader of its streaming jobs' token streams (api/token_streams.py), on the
session's real Redis: every follower gets its own stream's entries, in order, once; one
connection and fewer XREADs than entries serve them all; a stream followed while the XREAD
blocks joins at once; a lost connection loses nothing."""

from __future__ import annotations

import asyncio
import contextlib
import json

import redis.asyncio as aioredis

from api.token_streams import READER_NAME, TokenStreams
from llmpipe.jobs.streaming import apply_entries, is_end, stream_key


def _streams(redis_url: str, **kw) -> TokenStreams:
    return TokenStreams(redis_url, aioredis.Redis.from_url(redis_url), **kw)


def _entry(offset: int, ids: list[int]) -> dict:
    return {"i": 0, "o": offset, "d": json.dumps(ids)}


async def _until(cond, timeout: float = 10.0) -> bool:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.005)
    return True


async def _collect(f, want: int, timeout: float = 10.0) -> list:
    got: list = []
    async with asyncio.timeout(timeout):
        while len(got) < want:
            got += await f.next(timeout)
    return got


def _xreads(r) -> int:
    return int(r.info("commandstats").get("cmdstat_xread", {}).get("calls", 0))


def _reader_connections(r) -> list[dict]:
    return [c for c in r.client_list() if c.get("name") == READER_NAME]


def test_one_connection_and_fewer_reads_than_entries_serve_every_stream(redis_url, redis_client):
    """More streams than redis-py's asyncio pool holds connections (100 by default), with a
    command pool of two: an XREAD of its own per stream would fail ("Too many connections")."""
    jobs, rounds = [f"j{k}" for k in range(150)], 3

    async def run():
        streams = TokenStreams(redis_url, aioredis.Redis.from_url(redis_url, max_connections=2))
        try:
            async with contextlib.AsyncExitStack() as stack:
                followers = [await stack.enter_async_context(streams.follow(j)) for j in jobs]
                await _until(lambda: streams._reading)
                before = _xreads(redis_client)
                for n in range(rounds):  # as the inference worker writes a step: one pipeline for every stream
                    pipe = redis_client.pipeline(transaction=False)
                    for k, j in enumerate(jobs):
                        pipe.xadd(stream_key(j), _entry(n, [100 * k + n]))
                    pipe.execute()
                    for f in followers:
                        assert len(await f.next(5.0)) == 1
                reads = _xreads(redis_client) - before
                assert len(_reader_connections(redis_client)) == 1
            assert streams.following == 0
            return reads
        finally:
            await streams.close()

    reads = asyncio.run(run())
    # One XREAD per stream and step would be 450; the reader needs a few per step.
    assert reads < len(jobs) * rounds


def test_each_follower_gets_its_streams_entries_in_order_once_and_the_end(redis_url, redis_client):
    async def run():
        streams = _streams(redis_url)
        try:
            async with streams.follow("a") as fa, streams.follow("a") as fa2, streams.follow("b") as fb:
                redis_client.xadd(stream_key("a"), _entry(0, [1, 2]))
                redis_client.xadd(stream_key("b"), _entry(0, [9]))
                redis_client.xadd(stream_key("a"), _entry(2, [3]))
                redis_client.xadd(stream_key("a"), {"e": "succeeded"})
                a, a2, b = await _collect(fa, 3), await _collect(fa2, 3), await _collect(fb, 1)
                assert await fb.next(0.05) == []  # nothing more came: an empty answer after the wait
            return a, a2, b
        finally:
            await streams.close()

    a, a2, b = asyncio.run(run())
    assert apply_entries(a, {}) == {0: [1, 2, 3]} and is_end(a[-1][1])
    assert [e[0] for e in a2] == [e[0] for e in a]  # two responses of one job each get all of it
    assert apply_entries(b, {}) == {0: [9]}


def test_a_stream_followed_while_the_read_blocks_joins_it_at_once(redis_url, redis_client):
    async def run():
        streams = _streams(redis_url, block_ms=30_000)
        try:
            async with streams.follow("a"):
                await _until(lambda: streams._reading)
                async with streams.follow("b") as fb:
                    redis_client.xadd(stream_key("b"), _entry(0, [5]))
                    # Well inside the 30 s the first XREAD blocks for: the follow woke it.
                    return await fb.next(10.0)
        finally:
            await streams.close()

    got = asyncio.run(run())
    assert apply_entries(got, {}) == {0: [5]}


def test_a_lost_connection_wakes_the_followers_and_they_resume_where_they_were(redis_url, redis_client):
    async def run():
        streams = _streams(redis_url)
        try:
            async with streams.follow("a") as fa:
                redis_client.xadd(stream_key("a"), _entry(0, [1]))
                first = await _collect(fa, 1)
                await _until(lambda: streams._reading)
                (conn,) = _reader_connections(redis_client)
                redis_client.client_kill_filter(_id=conn["id"])
                assert await fa.next(10.0) == []  # woken with nothing: its response reads the record
                redis_client.xadd(stream_key("a"), _entry(1, [2]))
                second = await _collect(fa, 1)
                redis_client.xadd(stream_key("a"), _entry(2, [3]))
                rest = await streams.rest(fa)  # read now, without the reader
                return first, second, rest, streams.reconnects
        finally:
            await streams.close()

    first, second, rest, reconnects = asyncio.run(run())
    assert apply_entries(first + second + rest, {}) == {0: [1, 2, 3]}
    assert len({e[0] for e in first + second + rest}) == 3  # none twice
    assert reconnects >= 2
