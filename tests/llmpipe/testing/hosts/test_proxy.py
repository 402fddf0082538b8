"""The delaying TCP proxy on its own, on loopback: measured round trips, bytes intact both
ways, half-close, overlap of data in flight, and an unreachable target."""

from __future__ import annotations

import asyncio
import hashlib
import os
import statistics
import time

from llmpipe.testing.hosts.proxy import MAX_IN_FLIGHT, DelayProxy

LO = "127.0.0.1"


async def _echo_server():
    async def echo(reader, writer):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    return await asyncio.start_server(echo, LO, 0)


async def _round_trips(port: int, n: int, size: int = 64) -> list[float]:
    """Seconds per ping-pong of ``size`` bytes on one connection, like ``ping`` over TCP."""
    reader, writer = await asyncio.open_connection(LO, port)
    out = []
    msg = os.urandom(size)
    for _ in range(n):
        t0 = time.perf_counter()
        writer.write(msg)
        await writer.drain()
        assert await reader.readexactly(size) == msg
        out.append(time.perf_counter() - t0)
    writer.close()
    return out


def test_round_trip_adds_twice_the_one_way_delay():
    delay = 0.010

    async def main():
        server = await _echo_server()
        port = server.sockets[0].getsockname()[1]
        async with DelayProxy((LO, 0), (LO, port), delay) as proxy:
            direct = await _round_trips(port, 30)
            via = await _round_trips(proxy.port, 30)
        server.close()
        return direct, via

    direct, via = asyncio.run(main())
    added = statistics.median(via) - statistics.median(direct)
    # Never early: every round trip carries both one-way delays.
    assert min(via) >= 2 * delay - 0.0005, min(via)
    # The median adds 20 ms; the upper slack is for timer lateness on a busy machine.
    assert 2 * delay - 0.001 <= added <= 2 * delay + 0.010, (added, statistics.median(direct))


def test_bytes_pass_intact_both_ways_at_once():
    """Several MiB each way, beyond the proxy's in-flight limit, so flow control engages."""
    up_data = os.urandom(MAX_IN_FLIGHT + 1_500_000)
    down_data = os.urandom(MAX_IN_FLIGHT + 700_000)
    got: dict[str, bytes] = {}

    async def main():
        async def serve(reader, writer):
            async def read_all():
                got["server"] = await reader.read()  # to EOF

            task = asyncio.create_task(read_all())
            writer.write(down_data)
            await writer.drain()
            await task
            writer.close()

        server = await asyncio.start_server(serve, LO, 0)
        port = server.sockets[0].getsockname()[1]
        async with DelayProxy((LO, 0), (LO, port), 0.005) as proxy:
            reader, writer = await asyncio.open_connection(LO, proxy.port)

            async def send():
                for i in range(0, len(up_data), 100_000):
                    writer.write(up_data[i:i + 100_000])
                    await writer.drain()
                writer.write_eof()

            sender = asyncio.create_task(send())
            got["client"] = await reader.read()  # to EOF: the server closed after reading everything
            await sender
            writer.close()
            stats = proxy.stats
        server.close()
        return stats

    stats = asyncio.run(main())
    assert hashlib.sha256(got["server"]).digest() == hashlib.sha256(up_data).digest()
    assert hashlib.sha256(got["client"]).digest() == hashlib.sha256(down_data).digest()
    assert (stats.bytes_up, stats.bytes_down) == (len(up_data), len(down_data))


def test_half_close_keeps_the_other_direction_open():
    """The client sends its question and shuts down its sending side; the server reads to
    EOF and only then answers; the answer still reaches the client."""

    async def main():
        seen = {}

        async def serve(reader, writer):
            seen["question"] = await reader.read()  # returns only at EOF
            writer.write(b"answer to " + seen["question"])
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(serve, LO, 0)
        port = server.sockets[0].getsockname()[1]
        async with DelayProxy((LO, 0), (LO, port), 0.005) as proxy:
            reader, writer = await asyncio.open_connection(LO, proxy.port)
            writer.write(b"question")
            await writer.drain()
            writer.write_eof()
            answer = await asyncio.wait_for(reader.read(), 10)
            writer.close()
        server.close()
        return seen["question"], answer

    question, answer = asyncio.run(main())
    assert question == b"question"
    assert answer == b"answer to question"


def test_data_in_flight_overlaps_instead_of_queueing_behind_the_delay():
    """Ten messages sent 5 ms apart come back ~2 x delay after each was sent, not one
    round trip after another (which would take 10 x 2 x delay = 1 s)."""
    delay = 0.050

    async def main():
        server = await _echo_server()
        port = server.sockets[0].getsockname()[1]
        async with DelayProxy((LO, 0), (LO, port), delay) as proxy:
            reader, writer = await asyncio.open_connection(LO, proxy.port)
            t0 = time.perf_counter()
            for i in range(10):
                writer.write(b"%02d" % i)
                await writer.drain()
                await asyncio.sleep(0.005)
            echoed = await asyncio.wait_for(reader.readexactly(20), 10)
            took = time.perf_counter() - t0
            writer.close()
        server.close()
        return echoed, took

    echoed, took = asyncio.run(main())
    assert echoed == b"".join(b"%02d" % i for i in range(10))  # in order
    assert 2 * delay <= took < 0.5, took


def test_unreachable_target_closes_the_client_connection():
    async def main():
        placeholder = await asyncio.start_server(lambda r, w: None, LO, 0)
        dead_port = placeholder.sockets[0].getsockname()[1]
        placeholder.close()
        await placeholder.wait_closed()  # nothing listens there any more
        async with DelayProxy((LO, 0), (LO, dead_port), 0.005) as proxy:
            reader, writer = await asyncio.open_connection(LO, proxy.port)
            data = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            return data, proxy.stats.failed_connects

    data, failed = asyncio.run(main())
    assert data == b""
    assert failed == 1
