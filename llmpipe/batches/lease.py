"""Who feeds a batch: a lease in Redis, held by one API process and taken over when it lapses.

As the workers' leases (llmpipe/broker/leases.py), a lease is a holder and an expiry, and
each move is one Lua script, so two processes never both hold one batch: ``acquire`` takes
a lease that nobody holds or whose expiry has passed, ``renew`` pushes out the expiry of
the leases a process still holds (a background task does it every ttl / 3) and reports the
ones it lost, ``held`` checks one before the holder writes output (a process that stalled
past its expiry and woke up must not write for a batch another one took over), and
``release`` gives one back at once (a clean shutdown: another process takes over without
waiting out the TTL).

Times are Redis server time (``TIME`` inside the scripts), so API processes on hosts with
skewed clocks agree on when a lease lapsed; with a ``clock`` (tests: a fake one) or an
explicit ``now`` the scripts take that time instead.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from llmpipe.broker.leases import CLOCK_LUA, now_arg

_KEY = "llmpipe:batch-lease:"
KEEP_S = 7 * 24 * 3600  # a lease key nobody holds any more is dropped after this


# KEYS: lease. ARGV: now|'', owner, ttl, keep. Takes a lease nobody holds or whose expiry
# passed (or renews one the owner holds). Replies {1, previous holder or ''} or {0, holder}.
_ACQUIRE = CLOCK_LUA + """
local now = clock(ARGV[1])
local h = redis.call('HMGET', KEYS[1], 'holder', 'until')
if h[1] and h[1] ~= ARGV[2] and tonumber(h[2]) > now then return {0, h[1]} end
redis.call('HSET', KEYS[1], 'holder', ARGV[2], 'until', now + tonumber(ARGV[3]))
redis.call('HINCRBY', KEYS[1], 'takes', h[1] == ARGV[2] and 0 or 1)
redis.call('EXPIRE', KEYS[1], ARGV[4])
local prev = h[1] or ''
if prev == ARGV[2] then prev = '' end
return {1, prev}
"""

# KEYS: lease. ARGV: now|'', owner, ttl. 1 renewed; 0 another process holds it, or nobody
# (it was released or lapsed and was taken). A lease past its expiry that nobody took yet is
# renewed: nothing was handed on.
_RENEW = CLOCK_LUA + """
local now = clock(ARGV[1])
if redis.call('HGET', KEYS[1], 'holder') ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], 'until', now + tonumber(ARGV[3]))
return 1
"""

# KEYS: lease. ARGV: now|'', owner. 1 while the owner holds it and it has not lapsed.
_HELD = CLOCK_LUA + """
local now = clock(ARGV[1])
local h = redis.call('HMGET', KEYS[1], 'holder', 'until')
if h[1] == ARGV[2] and tonumber(h[2]) > now then return 1 end
return 0
"""

_RELEASE = """
if redis.call('HGET', KEYS[1], 'holder') ~= ARGV[1] then return 0 end
redis.call('HDEL', KEYS[1], 'holder', 'until')
return 1
"""


def lease_key(batch_id: str) -> str:
    return _KEY + batch_id


def new_owner() -> str:
    """host:pid:random: a lease's holder names the process (a log line, a test that kills it)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def owner_pid(owner: str) -> int | None:
    try:
        return int(owner.split(":")[-2])
    except (IndexError, ValueError):
        return None


@dataclass(frozen=True)
class Taken:
    ok: bool
    other: str | None = None  # ok: the holder whose lapsed lease this took over; else: who holds it


class BatchLeases:
    """The leases of one API process (``owner``), ``ttl_s`` long."""

    def __init__(self, r: Any, *, ttl_s: float, owner: str | None = None,
                 clock: Callable[[], float] | None = None):
        self.r = r
        self.ttl_s = ttl_s
        self.owner = owner or new_owner()
        self._clock = clock
        self._acquire = r.register_script(_ACQUIRE)
        self._renew = r.register_script(_RENEW)
        self._held = r.register_script(_HELD)
        self._release = r.register_script(_RELEASE)

    def _now(self, now: float | None) -> str:
        if now is None and self._clock is not None:
            now = self._clock()
        return now_arg(now)

    def acquire(self, batch_id: str, now: float | None = None) -> Taken:
        ok, other = self._acquire(keys=[lease_key(batch_id)], args=[self._now(now), self.owner, self.ttl_s, KEEP_S])
        other = _s(other) or None
        return Taken(bool(ok), other)

    def renew(self, batch_ids: Iterable[str], now: float | None = None) -> list[str]:
        """Push out the expiry of each lease; returns the ones this process no longer holds."""
        ids = list(batch_ids)
        if not ids:
            return []
        t = self._now(now)
        pipe = self.r.pipeline(transaction=False)
        for b in ids:
            self._renew(keys=[lease_key(b)], args=[t, self.owner, self.ttl_s], client=pipe)
        return [b for b, ok in zip(ids, pipe.execute(), strict=True) if not ok]

    def held(self, batch_id: str, now: float | None = None) -> bool:
        return bool(self._held(keys=[lease_key(batch_id)], args=[self._now(now), self.owner]))

    def release(self, batch_id: str) -> bool:
        return bool(self._release(keys=[lease_key(batch_id)], args=[self.owner]))

    def holder(self, batch_id: str) -> str | None:
        return _s(self.r.hget(lease_key(batch_id), "holder"))


def _s(v: Any) -> Any:
    return v.decode() if isinstance(v, bytes) else v
