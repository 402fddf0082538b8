"""A TCP proxy that delays every byte by a fixed time in each direction: a network hop's
latency, for machines whose kernel has no ``netem`` qdisc.

``python -m llmpipe.testing.hosts.proxy --listen 10.231.0.12:40001 --target 10.231.0.10:6379 --delay-ms 10``

What it models: a link with a one-way latency of ``delay`` and no bandwidth limit. Each
chunk read from one side is written to the other ``delay`` seconds after it was read, in
order; chunks in flight overlap (a stream of requests is not serialised behind each
other's delay), as on a real link. A round trip through the proxy therefore takes 2 x
``delay`` more than a direct one. End of stream is forwarded with the same delay as a
half-close (``shutdown(SHUT_WR)``), so the other direction keeps flowing; a closed or reset
connection closes its peer once the data before it has been delivered. Not modelled: the
TCP handshake's own round trip (a connection is accepted at once and the upstream
connection opened then), loss, reordering and bandwidth.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections import deque
from dataclasses import dataclass

_EOF = object()
_CLOSE = object()
# Bytes delayed in one direction before the proxy stops reading that side (flow control).
MAX_IN_FLIGHT = 4 * 1024 * 1024


@dataclass
class ProxyStats:
    connections: int = 0
    failed_connects: int = 0
    bytes_up: int = 0  # client -> target
    bytes_down: int = 0  # target -> client


class _Side(asyncio.Protocol):
    """One of the two TCP connections of a proxied pair."""

    def __init__(self, pair: _Pair, name: str):
        self.pair = pair
        self.name = name
        self.transport: asyncio.Transport | None = None
        self._pauses: set[str] = set()

    def pause(self, why: str) -> None:
        if not self._pauses and self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()
        self._pauses.add(why)

    def resume(self, why: str) -> None:
        self._pauses.discard(why)
        if not self._pauses and self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def connection_made(self, transport) -> None:
        self.transport = transport
        if self._pauses:
            transport.pause_reading()

    def data_received(self, data: bytes) -> None:
        self.pair.send(self, data)

    def eof_received(self) -> bool:
        self.pair.send(self, _EOF)
        return True  # half-close: keep writing the other direction

    def connection_lost(self, exc) -> None:
        self.pair.lost(self)

    def pause_writing(self) -> None:
        self.pair.other(self).pause("peer-buffer")

    def resume_writing(self) -> None:
        self.pair.other(self).resume("peer-buffer")


class _Direction:
    """Items read from ``src``, delivered to ``dst`` ``delay`` seconds later, in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop, delay: float, src: _Side, dst: _Side, count):
        self.loop, self.delay, self.src, self.dst, self.count = loop, delay, src, dst, count
        self.items: deque = deque()
        self.in_flight = 0
        self.timer: asyncio.TimerHandle | None = None
        self.done = False  # EOF or close delivered

    def push(self, item) -> None:
        self.items.append((self.loop.time() + self.delay, item))
        if isinstance(item, bytes):
            self.in_flight += len(item)
            if self.in_flight > MAX_IN_FLIGHT:
                self.src.pause("in-flight")
        if self.timer is None:
            self.timer = self.loop.call_at(self.items[0][0], self._deliver)

    def _deliver(self) -> None:
        self.timer = None
        # call_at may fire up to the clock's resolution early.
        now = self.loop.time() + 1e-6
        dst = self.dst.transport
        while self.items and self.items[0][0] <= now:
            _, item = self.items.popleft()
            if item is _EOF:
                if dst is not None and not dst.is_closing() and dst.can_write_eof():
                    dst.write_eof()
                self.done = True
                self.src.pair.check_done()
            elif item is _CLOSE:
                self.src.pair.close()
                return
            else:
                if dst is not None and not dst.is_closing():
                    dst.write(item)
                    self.count(len(item))
                self.in_flight -= len(item)
                if self.in_flight <= MAX_IN_FLIGHT:
                    self.src.resume("in-flight")
        if self.items:
            self.timer = self.loop.call_at(self.items[0][0], self._deliver)

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class _Pair:
    def __init__(self, proxy: DelayProxy):
        self.proxy = proxy
        loop = asyncio.get_running_loop()
        self.client = _Side(self, "client")
        self.target = _Side(self, "target")
        # Bytes the client sends before the target connection is up wait in the kernel.
        self.client.pause("connecting")
        self.up = _Direction(loop, proxy.delay, self.client, self.target, self._count_up)
        self.down = _Direction(loop, proxy.delay, self.target, self.client, self._count_down)
        self.closed = False

    def _count_up(self, n: int) -> None:
        self.proxy.stats.bytes_up += n

    def _count_down(self, n: int) -> None:
        self.proxy.stats.bytes_down += n

    def other(self, side: _Side) -> _Side:
        return self.target if side is self.client else self.client

    def send(self, side: _Side, item) -> None:
        (self.up if side is self.client else self.down).push(item)

    def lost(self, side: _Side) -> None:
        """``side`` closed or was reset: its peer is closed once the data read before
        that has been delivered."""
        if not self.closed:
            (self.up if side is self.client else self.down).push(_CLOSE)

    def check_done(self) -> None:
        """Both directions delivered their EOF: the exchange is over."""
        if self.up.done and self.down.done:
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.up.cancel()
        self.down.cancel()
        for side in (self.client, self.target):
            if side.transport is not None:
                side.transport.close()
        self.proxy.pairs.discard(self)


class DelayProxy:
    """Listens on ``listen`` and forwards each connection to ``target``, delaying both
    directions by ``delay_s``. Use ``await start()`` / ``await close()`` or ``async with``."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], delay_s: float):
        if delay_s < 0:
            raise ValueError("delay_s must be >= 0")
        self.listen = listen
        self.target = target
        self.delay = delay_s
        self.stats = ProxyStats()
        self.pairs: set[_Pair] = set()
        self._server: asyncio.base_events.Server | None = None

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]

    async def start(self) -> DelayProxy:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._accept, self.listen[0], self.listen[1], reuse_address=True)
        return self

    def _accept(self) -> _Side:
        pair = _Pair(self)
        self.pairs.add(pair)
        self.stats.connections += 1
        asyncio.get_running_loop().create_task(self._connect(pair))
        return pair.client

    async def _connect(self, pair: _Pair) -> None:
        try:
            await asyncio.get_running_loop().create_connection(lambda: pair.target, *self.target)
        except OSError:
            self.stats.failed_connects += 1
            pair.close()
            return
        if pair.closed:  # the client left meanwhile
            pair.target.transport.close()
        else:
            pair.client.resume("connecting")

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for pair in list(self.pairs):
            pair.close()

    async def __aenter__(self) -> DelayProxy:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"want HOST:PORT, got {text!r}")
    return host, int(port)


async def _serve(listen: tuple[str, int], target: tuple[str, int], delay_s: float) -> None:
    proxy = await DelayProxy(listen, target, delay_s).start()
    print(f"llmpipe-proxy: {listen[0]}:{proxy.port} -> {target[0]}:{target[1]}, {delay_s * 1000:g} ms each way",
          flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    s = proxy.stats
    print(f"llmpipe-proxy: {s.connections} connections ({s.failed_connects} failed), "
          f"{s.bytes_up} bytes up, {s.bytes_down} bytes down", flush=True)
    await proxy.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m llmpipe.testing.hosts.proxy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--listen", type=_addr, required=True, help="HOST:PORT to listen on")
    ap.add_argument("--target", type=_addr, required=True, help="HOST:PORT to forward to")
    ap.add_argument("--delay-ms", type=float, required=True, help="added latency in EACH direction")
    a = ap.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(a.listen, a.target, a.delay_ms / 1000.0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
