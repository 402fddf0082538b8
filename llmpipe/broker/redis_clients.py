"""Every Redis client llmpipe makes comes from here: one URL, several kinds of server.

``redis://`` and ``rediss://`` (TLS) name one server, ``unix:///path.sock?db=0`` a local
socket, and ``sentinel://`` a Redis Sentinel group, in the form Celery and kombu use::

    sentinel://10.0.0.1:26379/0;sentinel://10.0.0.2:26379/0;sentinel://10.0.0.3:26379/0

Each ``;``-separated part names one sentinel (port 26379 when left out); the database and
the master's credentials (``sentinel://:PASSWORD@host:port/0``) come from the first part
that carries them. The master's name (``sentinel monitor <name> ...``) is a setting
(``redis_sentinel_master``), as kombu and Celery take it in their transport options. A
client of a Sentinel URL asks the sentinels for the master on every new connection, so
after a failover it reconnects to the promoted replica by itself; while no master is known
it raises ``MasterNotFoundError``, a ``ConnectionError``, which the API answers with 503.

The broker, the result backend, the job store, admission and the token streams all read
the same URL: :func:`celery_options` gives Celery its view of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry
from redis.sentinel import Sentinel

SCHEMES = ("redis", "rediss", "unix", "sentinel")
SENTINEL_PORT = 26379
DEFAULT_MASTER = "mymaster"


# Errors that mean "no writable Redis right now", never "this request is wrong": a lost
# connection or a timeout, no master known to the sentinels (MasterNotFoundError is a
# ConnectionError), or a write that reached a replica (a plain URL naming a node that a
# failover demoted). The API answers them 503 (api/errors.py).
UNAVAILABLE_ERRORS: tuple[type[Exception], ...] = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                                                   redis.exceptions.ReadOnlyError)


class RedisUrlError(ValueError):
    """A Redis URL that no client here can use."""


@dataclass(frozen=True)
class SentinelUrl:
    sentinels: tuple[tuple[str, int], ...]
    db: int = 0
    username: str | None = None
    password: str | None = None

    @property
    def url(self) -> str:
        """The canonical form: every part carries the database and the credentials, since
        kombu reads them from the first part and Celery from each."""
        auth = ""
        if self.password is not None or self.username is not None:
            auth = f"{self.username or ''}:{self.password or ''}@"
        return ";".join(f"sentinel://{auth}{_host(h)}:{p}/{self.db}" for h, p in self.sentinels)

    def connection_kwargs(self) -> dict[str, Any]:
        """What the master's connections need besides an address."""
        kw: dict[str, Any] = {"db": self.db}
        if self.username is not None:
            kw["username"] = self.username
        if self.password is not None:
            kw["password"] = self.password
        return kw


def _host(h: str) -> str:
    return f"[{h}]" if ":" in h else h


def scheme(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else ""


def is_sentinel(url: str) -> bool:
    return scheme(url) == "sentinel"


def parse_sentinel(url: str) -> SentinelUrl:
    hosts: list[tuple[str, int]] = []
    db: int | None = None
    username = password = None
    for part in filter(None, (p.strip() for p in url.split(";"))):
        u = urlsplit(part)
        if u.scheme.lower() != "sentinel":
            raise RedisUrlError(f"every part of a Sentinel URL starts with sentinel://, not {part.split('://')[0]}://")
        try:
            port = u.port or SENTINEL_PORT
        except ValueError as exc:
            raise RedisUrlError(f"bad port in {part!r}: {exc}") from None
        if not u.hostname:
            raise RedisUrlError(f"no host in {part!r}")
        hosts.append((u.hostname, port))
        path = u.path.strip("/")
        if path:
            if not path.isdigit():
                raise RedisUrlError(f"the database in {part!r} must be a number, not {path!r}")
            if db is not None and int(path) != db:
                raise RedisUrlError(f"the parts of {url!r} name different databases ({db} and {path})")
            db = int(path)
        if u.password is not None and password is None:
            password, username = unquote(u.password), unquote(u.username) if u.username else None
    if not hosts:
        raise RedisUrlError("a Sentinel URL names at least one sentinel: sentinel://host:26379/0")
    return SentinelUrl(tuple(hosts), db or 0, username, password)


def check_url(url: str) -> str:
    """``url`` if a client here can use it, else :class:`RedisUrlError` saying why."""
    s = scheme(url)
    if s not in SCHEMES:
        raise RedisUrlError(f"a Redis URL starts with {', '.join(x + '://' for x in SCHEMES)}; got {url.split('://')[0]!r}")
    if s == "sentinel":
        parse_sentinel(url)
    return url


def safe_url(url: str) -> str:
    """``url`` without passwords, for logs and banners."""
    def one(part: str) -> str:
        u = urlsplit(part)
        if u.password is None:
            return part
        netloc = f"{u.username or ''}:**@{u.netloc.rsplit('@', 1)[1]}"
        return u._replace(netloc=netloc).geturl()

    return ";".join(one(p) for p in url.split(";"))


# ---------------------------------------------------------------------------- clients


def connect(url: str, master_name: str = DEFAULT_MASTER, **kwargs: Any) -> redis.Redis:
    """A redis-py client of ``url``; ``kwargs`` are redis-py's (socket_timeout, ...). For a
    Sentinel URL they apply to the master's connections and their ``socket_*`` ones to the
    sentinels' too."""
    if not is_sentinel(url):
        return redis.Redis.from_url(url, **kwargs)
    su = parse_sentinel(url)
    sentinel = Sentinel(list(su.sentinels), sentinel_kwargs={**_sentinel_kwargs(kwargs), "retry": Retry(NoBackoff(), 0)})
    return sentinel.master_for(master_name, redis_class=redis.Redis, **su.connection_kwargs(), **kwargs)


def aconnect(url: str, master_name: str = DEFAULT_MASTER, **kwargs: Any) -> aioredis.Redis:
    """The asyncio twin of :func:`connect`."""
    if not is_sentinel(url):
        return aioredis.Redis.from_url(url, **kwargs)
    su = parse_sentinel(url)
    sentinel = AsyncSentinel(list(su.sentinels), sentinel_kwargs={**_sentinel_kwargs(kwargs), "retry": AsyncRetry(NoBackoff(), 0)})
    return sentinel.master_for(master_name, redis_class=aioredis.Redis, **su.connection_kwargs(), **kwargs)


def _sentinel_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    # A sentinel that does not answer must not hold a client longer than its master would;
    # and no retries on one sentinel (the callers add a retry): the next one is asked.
    return {k: v for k, v in kwargs.items() if k in ("socket_timeout", "socket_connect_timeout", "socket_keepalive")}


def fail_fast_retry() -> Retry:
    """For clients that answer a request (the API): about 0.3 s of retries, then the error
    (503 at the HTTP edge), as the API's publishing does (celeryconfig). redis-py's default
    (10 retries, up to about 4 s) would hold a request through a short Sentinel failover one
    time and answer 503 the next."""
    return Retry(ExponentialBackoff(cap=0.2, base=0.02), 3)


def ride_through_retry() -> Retry:
    """For the workers' clients: retries for about 12 s, as long as a Redis restart takes
    (a restart under docker compose: under a second; a Sentinel failover: seconds), so that
    a stage's job-store write waits for Redis instead of failing the task. A task that still
    fails this way goes back to its queue (llmpipe/broker/requeue.py)."""
    return Retry(ExponentialBackoff(cap=1.0, base=0.05), 16)


def from_settings(s: Any, **kwargs: Any) -> redis.Redis:
    """A client of the settings' Redis (``redis_url``, ``redis_sentinel_master``)."""
    return connect(s.redis_url, s.redis_sentinel_master, **kwargs)


def afrom_settings(s: Any, **kwargs: Any) -> aioredis.Redis:
    return aconnect(s.redis_url, s.redis_sentinel_master, **kwargs)


# ---------------------------------------------------------------------------- Celery


def celery_url(url: str) -> str:
    """The URL Celery and kombu are given: a Sentinel URL in its canonical form."""
    return parse_sentinel(url).url if is_sentinel(url) else url


def celery_probe(broker_url: str, backend_url: str | None = None, master_name: str = DEFAULT_MASTER):
    """A bare Celery app for control commands (pings): the broker (Redis, Sentinel or
    RabbitMQ) and the result backend (``broker_url`` when not given)."""
    from celery import Celery

    backend_url = backend_url or broker_url
    app = Celery(broker=celery_url(broker_url), backend=celery_url(backend_url))
    app.conf.update(broker_transport_options=sentinel_transport_options(broker_url, master_name),
                    result_backend_transport_options=sentinel_transport_options(backend_url, master_name))
    return app


def sentinel_transport_options(url: str, master_name: str, *, socket_timeout: float = 5.0,
                               socket_connect_timeout: float = 3.0) -> dict[str, Any]:
    """What kombu's ``sentinel://`` transport and Celery's Sentinel result backend need in
    their transport options besides the URL (empty for any other URL)."""
    if not is_sentinel(url):
        return {}
    # Without sentinel_kwargs, Celery's backend talks to the sentinels with no timeout at
    # all: a sentinel host that vanished would hang every result read.
    return {"master_name": master_name,
            "sentinel_kwargs": {"socket_timeout": socket_timeout, "socket_connect_timeout": socket_connect_timeout}}
