"""One Redis URL for every client: redis://, rediss://, unix:// and sentinel:// (in the
form Celery and kombu use), the Celery options derived from it, and the errors that mean
"no writable Redis" answered 503. The last tests run a real master and sentinel on
loopback; the failover itself is tests/llmpipe/hosts/test_sentinel_failover.py."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest
import redis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import ValidationError
from redis.sentinel import MasterNotFoundError, SentinelConnectionPool

from llmpipe.broker.polling_backend import PollingRedisBackend, PollingSentinelBackend, polling_backend_url
from llmpipe.broker.redis_clients import (
    RedisUrlError,
    aconnect,
    celery_url,
    check_url,
    connect,
    parse_sentinel,
    safe_url,
    sentinel_transport_options,
)
from llmpipe.local.redis_server import free_port, redis_binary
from llmpipe.local.supervisor import python_env
from llmpipe.settings import Settings


def test_a_sentinel_url_names_each_sentinel_and_one_database():
    u = parse_sentinel("sentinel://10.0.0.1:26380;sentinel://10.0.0.2/2;sentinel://[fd00::3]:26381/2")
    assert u.sentinels == (("10.0.0.1", 26380), ("10.0.0.2", 26379), ("fd00::3", 26381))
    assert u.db == 2 and u.password is None
    # Canonical: every part carries the database (kombu reads the first, Celery each).
    assert u.url == "sentinel://10.0.0.1:26380/2;sentinel://10.0.0.2:26379/2;sentinel://[fd00::3]:26381/2"
    assert celery_url("sentinel://a;sentinel://b/1") == "sentinel://a:26379/1;sentinel://b:26379/1"
    assert celery_url("redis://h:1/3") == "redis://h:1/3"
    auth = parse_sentinel("sentinel://user:s%40cret@a:1/0;sentinel://b:2/0")
    assert (auth.username, auth.password) == ("user", "s@cret")
    assert auth.connection_kwargs() == {"db": 0, "username": "user", "password": "s@cret"}


@pytest.mark.parametrize("url, why", [
    ("sentinel://a/1;sentinel://b/2", "different databases"),
    ("sentinel://a/zero", "must be a number"),
    ("sentinel://a;redis://b", "every part"),
    ("sentinel://:26379", "no host"),
    ("sentinel://", "no host"),
    ("http://a:6379", "starts with"),
    ("a:6379", "starts with"),
])
def test_urls_no_client_can_use_are_refused_with_the_reason(url, why):
    with pytest.raises(RedisUrlError, match=why):
        check_url(url)
    with pytest.raises(ValidationError, match=why):
        Settings(redis_url=url)


def test_settings_take_every_kind_of_url():
    for url in ("redis://h:1/0", "rediss://h:1/0", "unix:///run/redis.sock?db=1", "sentinel://h:1/0", "embedded"):
        assert Settings(redis_url=url).redis_url == url
    assert Settings().redis_sentinel_master == "mymaster"


def test_passwords_are_hidden_in_every_part():
    assert safe_url("sentinel://:pw@a:1/0;sentinel://u:pw@b:2/0") == "sentinel://:**@a:1/0;sentinel://u:**@b:2/0"
    assert safe_url("redis://a:1/0") == "redis://a:1/0"


def test_celery_gets_the_master_name_only_for_sentinel():
    assert sentinel_transport_options("redis://a/0", "m") == {}
    opts = sentinel_transport_options("sentinel://a/0", "m", socket_timeout=5, socket_connect_timeout=3)
    assert opts == {"master_name": "m", "sentinel_kwargs": {"socket_timeout": 5, "socket_connect_timeout": 3}}


def test_celeryconfig_derives_broker_and_backend_from_a_sentinel_url():
    code = ("import json, celeryconfig as c; from celery import Celery; app = Celery(); "
            "app.config_from_object('celeryconfig'); b = app.backend; "
            "print(json.dumps([c.broker_url, c.result_backend, c.broker_transport_options, "
            "c.result_backend_transport_options, c.broker_transport, type(b).__name__, "
            "b._transport_options.get('master_name')]))")
    env = python_env({"LLMPIPE_REDIS_URL": "sentinel://s1:26379;sentinel://s2:26379/4", "LLMPIPE_REDIS_SENTINEL_MASTER": "pipe"})
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    broker, backend, bopts, ropts, transport, backend_cls, backend_master = json.loads(out.stdout)
    assert broker == "sentinel://s1:26379/4;sentinel://s2:26379/4"
    # Celery's Sentinel backend with the bounded outcome retry (llmpipe/broker/result_backend.py)
    assert backend == "llmpipe.broker.result_backend:OutcomeSentinelBackend+" + broker
    assert (backend_cls, backend_master) == ("OutcomeSentinelBackend", "pipe")
    assert transport == "llmpipe.broker.redis_transport:SentinelTransport"  # worker leases over Sentinel
    assert bopts["master_name"] == ropts["master_name"] == "pipe"
    assert bopts["visibility_timeout"] > 0 and ropts["retry_policy"]  # the other options stay


def test_clients_of_a_sentinel_url_ask_for_the_named_master():
    r = connect("sentinel://:pw@127.0.0.1:1/3", "pipe", socket_timeout=1)
    pool = r.connection_pool
    assert isinstance(pool, SentinelConnectionPool) and pool.service_name == "pipe"
    assert pool.connection_kwargs["db"] == 3 and pool.connection_kwargs["password"] == "pw"
    assert pool.connection_kwargs["socket_timeout"] == 1
    with pytest.raises(MasterNotFoundError):  # nothing listens there: no master, a ConnectionError
        r.ping()
    ar = aconnect("sentinel://127.0.0.1:1/3", "pipe", socket_timeout=1)
    assert ar.connection_pool.service_name == "pipe" and ar.connection_pool.connection_kwargs["db"] == 3
    assert isinstance(connect("redis://127.0.0.1:1/2").connection_pool, redis.ConnectionPool)


def test_the_api_polling_backend_follows_the_url():
    from celery import Celery

    assert polling_backend_url("redis://a:1/0") == "llmpipe.broker.polling_backend:PollingRedisBackend+redis://a:1/0"
    url = polling_backend_url("sentinel://a:1;sentinel://b:2/5")
    app = Celery(backend=url)
    app.conf.result_backend_transport_options = {"master_name": "pipe"}
    backend = app.backend
    assert isinstance(backend, PollingSentinelBackend) and not isinstance(backend, PollingRedisBackend)
    assert [(h["host"], h["port"]) for h in backend.connparams["hosts"]] == [("a", 1), ("b", 2)]
    assert backend.connparams["db"] == 5


@pytest.mark.parametrize("exc", [MasterNotFoundError("No master found for 'mymaster'"),
                                 redis.exceptions.ReadOnlyError("You can't write against a read only replica.")])
def test_no_writable_redis_is_503_at_the_http_edge(exc):
    from api import errors

    app = FastAPI()
    errors.install(app)

    @app.get("/boom")
    def boom():
        raise exc

    r = TestClient(app, raise_server_exceptions=False).get("/boom")
    assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable"
    assert r.headers["retry-after"] and r.headers[errors.RETRY_HEADER] == "true"


# ------------------------------------------------------------------ a real sentinel


@pytest.fixture(scope="module")
def sentinel(tmp_path_factory):
    """A master and one sentinel that watches it, on loopback."""
    d = tmp_path_factory.mktemp("sentinel")
    mport, sport = free_port(), free_port()
    conf = d / "sentinel.conf"
    conf.write_text(f"sentinel monitor pipe 127.0.0.1 {mport} 1\n")
    procs = [subprocess.Popen([redis_binary(), "--port", str(mport), "--bind", "127.0.0.1", "--save", "", "--dir", str(d)],
                              stdout=subprocess.DEVNULL),
             subprocess.Popen([redis_binary(), str(conf), "--port", str(sport), "--bind", "127.0.0.1", "--dir", str(d),
                               "--sentinel"], stdout=subprocess.DEVNULL)]
    url = f"sentinel://127.0.0.1:{sport}/1"
    try:
        end = time.monotonic() + 20
        while True:
            # The sentinel names the master from its file, before the master may listen:
            # both must answer (a first command once met only the sentinel, under load).
            try:
                if redis.Redis(port=sport).sentinel_get_master_addr_by_name("pipe") and redis.Redis(port=mport).ping():
                    break
            except redis.ConnectionError:
                pass
            assert time.monotonic() < end, "the sentinel or its master did not start"
            time.sleep(0.05)
        yield url, mport
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)


def test_sync_and_asyncio_clients_reach_the_master_through_the_sentinel(sentinel):
    url, mport = sentinel
    r = connect(url, "pipe", socket_timeout=2)
    r.set("k", "v")
    assert redis.Redis(port=mport, db=1).get("k") == b"v"  # the master's database 1, as the URL says

    async def roundtrip():
        ar = aconnect(url, "pipe", socket_timeout=2)
        ps = ar.pubsub()
        await ps.subscribe("ch")
        assert (await ps.get_message(timeout=2))["type"] == "subscribe"
        await ar.publish("ch", "x")
        msg = await ps.get_message(timeout=2)
        await ps.aclose()
        await ar.aclose()
        return msg["data"]

    assert asyncio.run(roundtrip()) == b"x"
    with pytest.raises(MasterNotFoundError):
        connect(url, "nosuch", socket_timeout=2).ping()


def test_kombu_and_celery_run_over_the_sentinel(sentinel):
    from celery import Celery
    from kombu import Connection

    url, mport = sentinel
    opts = sentinel_transport_options(url, "pipe")
    with Connection(celery_url(url), transport_options=opts) as conn:
        q = conn.SimpleQueue("sentinel-test")
        q.put({"n": 1})
        msg = q.get(timeout=5)
        msg.ack()
        assert msg.payload == {"n": 1}
        q.close()
    app = Celery(backend=polling_backend_url(url))
    app.conf.result_backend_transport_options = opts
    app.backend.store_result("task-1", {"ok": True}, "SUCCESS")
    assert app.AsyncResult("task-1").result == {"ok": True}
    assert redis.Redis(port=mport, db=1).exists("celery-task-meta-task-1")


def test_the_leased_transport_runs_over_the_sentinel(sentinel):
    """Worker leases (llmpipe/broker/redis_transport.py) over Sentinel: consuming claims under a
    lease kept on the master the sentinel names, acks clear what the lease held."""
    import socket

    from kombu import Connection, Consumer, Exchange, Producer, Queue

    from llmpipe.broker.leases import LEASES_KEY
    from llmpipe.broker.redis_transport import SentinelChannel, transport_for

    url, mport = sentinel
    got = []
    with Connection(celery_url(url), transport=transport_for(url), transport_options=sentinel_transport_options(url, "pipe")) as conn:
        q = Queue("lease-test", Exchange("lease-test"), "lease-test")
        with Producer(conn.channel()) as p:
            for i in range(3):
                p.publish({"i": i}, exchange=q.exchange, routing_key="lease-test", declare=[q])

        def on_message(body, msg):
            got.append(body)
            msg.ack()

        with Consumer(conn, [q], callbacks=[on_message]):
            end = time.monotonic() + 10
            while len(got) < 3 and time.monotonic() < end:
                try:
                    conn.drain_events(timeout=1)
                except socket.timeout:
                    pass
        channel = conn.default_channel
        assert isinstance(channel, SentinelChannel)
        assert isinstance(channel._lease_store.r.connection_pool, SentinelConnectionPool)
        master = redis.Redis(port=mport, db=1)
        assert master.zcard(LEASES_KEY) == 1  # the consumer's lease, on the master
        assert not master.hlen("unacked")  # every claim acked
    assert got == [{"i": 0}, {"i": 1}, {"i": 2}]


def test_a_workers_client_waits_out_a_redis_restart():
    """The workers' retries last longer than a restart (under a second here under docker
    compose, seconds for a Sentinel failover); the API's stay short (it answers 503)."""
    from redis.retry import Retry

    from llmpipe.broker.redis_clients import fail_fast_retry, ride_through_retry

    def waits(r: Retry) -> float:
        return sum(r._backoff.compute(i) for i in range(1, r._retries + 1))

    assert waits(ride_through_retry()) >= 10.0
    assert waits(fail_fast_retry()) <= 0.5
