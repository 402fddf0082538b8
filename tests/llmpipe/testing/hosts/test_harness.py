"""The hosts harness: namespaces that reach each other and nothing else, a measured 20 ms
round trip on a route, partition and host death (for failover tests), applications stopped
before the Redis they talk to, and a complete tear-down when the owner fails or is killed."""

from __future__ import annotations

import errno
import os
import signal
import socket
import statistics
import subprocess
import sys
import textwrap
import time

import pytest
import redis

from llmpipe.local.supervisor import alive, python_env
from llmpipe.testing.hosts import netns

pytestmark = pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))


def _ping_rtts(address: str, n: int = 15) -> list[float]:
    host, port = address.rsplit(":", 1)
    r = redis.Redis(host=host, port=int(port), socket_connect_timeout=2, socket_timeout=5)
    r.ping()  # connect outside the measurement
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        r.ping()
        out.append(time.perf_counter() - t0)
    r.close()
    return out


def _connect_error(address: str, port: int) -> int | None:
    try:
        socket.create_connection((address, port), timeout=1).close()
    except TimeoutError:  # no answer at all (its errno is None)
        return errno.ETIMEDOUT
    except OSError as e:
        return e.errno
    return None


def _root_links() -> set[str]:
    return {line.split(":")[1].strip().split("@")[0] for line in netns.ip("-o", "link", "show").splitlines()}


def test_hosts_reach_each_other_and_nothing_else(hosts):
    links_before = _root_links()
    a, b = hosts.add("a"), hosts.add("b")
    assert a.address != b.address and {a.address, b.address} <= {str(x) for x in hosts.subnet.hosts()}
    url = hosts.start_redis("b")
    assert hosts.call("a", lambda: redis.Redis.from_url(url, socket_connect_timeout=2).ping())
    # The host's only route is the harness's subnet: every other address is unreachable
    # without a packet leaving the namespace.
    routes = netns.ip("-n", a.ns, "-4", "route", "show").strip().splitlines()
    assert len(routes) == 1 and routes[0].startswith(str(hosts.subnet)), routes
    outside = [str(n.network_address + 1) for n in netns.root_networks() if not n.is_loopback]
    for address in outside:
        assert hosts.call("a", _connect_error, address, 80) == errno.ENETUNREACH
    # Loopback inside a host is the host's own: the machine's Redis on 127.0.0.1:6379 is
    # not there.
    assert hosts.call("a", _connect_error, "127.0.0.1", 6379) == errno.ECONNREFUSED
    # Nothing was added to the root namespace.
    assert _root_links() == links_before


def test_a_route_adds_twenty_ms_to_each_round_trip(hosts):
    hosts.add("client")
    hosts.add("server")
    hosts.start_redis("server")
    via = hosts.route("client", "server", 6379)
    assert via.startswith(hosts.addr("client") + ":")  # the proxy listens on the source's own address
    assert hosts.route("client", "server", 6379) == via  # one proxy per path
    direct = hosts.call("client", _ping_rtts, f"{hosts.addr('server')}:6379")
    delayed = hosts.call("client", _ping_rtts, via)
    assert statistics.median(direct) < 0.005, direct
    assert min(delayed) >= 0.0195, delayed
    assert 0.0195 <= statistics.median(delayed) <= 0.030, delayed


def test_partition_cuts_a_host_off_and_heal_restores_it(hosts):
    hosts.add("a")
    hosts.add("b")
    hosts.start_redis("b")
    target = hosts.addr("b")
    assert hosts.call("a", _connect_error, target, 6379) is None
    hosts.partition("b")
    assert hosts.call("a", _connect_error, target, 6379) == errno.ETIMEDOUT
    hosts.heal("b")
    end = time.monotonic() + 10
    while hosts.call("a", _connect_error, target, 6379) is not None:
        assert time.monotonic() < end, "b still unreachable after heal"
        time.sleep(0.1)


def test_kill_host_kills_every_process_in_it(hosts):
    hosts.add("doomed")
    hosts.start_redis("doomed")
    sleeper = hosts.spawn("doomed", "sleeper", ["sleep", "600"])
    killed = hosts.kill_host("doomed")
    assert sleeper.proc.pid in killed and len(killed) >= 2
    assert netns.ns_pids(hosts.hosts["doomed"].ns) == []
    sleeper.proc.wait(5)


# A process whose warm shutdown writes to Redis, as a Celery worker's does (its readiness key).
_WRITES_ON_SIGTERM = textwrap.dedent("""
    import signal, sys, time
    import redis
    r = redis.Redis.from_url(sys.argv[1], socket_connect_timeout=1, socket_timeout=1)
    def stop(*_):
        time.sleep(0.5)  # its work in hand ends first
        r.set("stopped", "warm")
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    r.set("started", "1")
    while True:
        time.sleep(1)
""")


def test_applications_stop_before_the_redis_they_talk_to(hosts):
    hosts.add("a")
    url = hosts.start_redis("a")
    hosts.spawn("a", "app", [sys.executable, "-c", _WRITES_ON_SIGTERM, url])
    r = redis.Redis.from_url(url, socket_connect_timeout=2)
    end = time.monotonic() + 30
    while hosts.call("a", r.get, "started") is None:
        assert time.monotonic() < end, "the app did not start"
        time.sleep(0.1)
    assert hosts.stop_children(timeout=10)  # warm: the app's last write reached Redis
    app = next(c for c in hosts.sup.children if c.name == "a.app")
    assert app.proc.returncode == 0


_OWNER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from llmpipe.testing.hosts.harness import Hosts
    with Hosts(Path(sys.argv[1])) as h:
        h.add("x")
        child = h.spawn("x", "sleeper", ["sleep", "600"])
        print(h.prefix, child.proc.pid, flush=True)
        if sys.argv[2] == "fail":
            raise RuntimeError("the test failed")
        time.sleep(600)
""")


def _start_owner(tmp_path, how: str) -> tuple[subprocess.Popen, str, int]:
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, str(tmp_path / "logs"), how], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=python_env({}))
    prefix, pid = owner.stdout.readline().split()
    return owner, prefix, int(pid)


def _wait_dead(pid: int, timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while alive(pid):
        assert time.monotonic() < end, f"process {pid} still alive"
        time.sleep(0.05)


@pytest.mark.skipif(netns.available() is not None, reason="needs root")
def test_tear_down_is_complete_when_the_owner_fails(tmp_path):
    owner, prefix, pid = _start_owner(tmp_path, "fail")
    assert owner.wait(60) != 0
    assert "the test failed" in owner.stderr.read()
    assert not [n for n in netns.list_netns() if n.startswith(prefix)]
    _wait_dead(pid, 1)


@pytest.mark.skipif(netns.available() is not None, reason="needs root")
def test_a_killed_owners_hosts_are_removed_by_the_next_run(tmp_path):
    owner, prefix, pid = _start_owner(tmp_path, "hang")
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait(10)
    _wait_dead(pid)  # PR_SET_PDEATHSIG: the owner's children die with it
    assert [n for n in netns.list_netns() if n.startswith(prefix)], "nothing was left to clean: test is moot"
    removed = netns.clean_stale()
    assert {n for n in removed if n.startswith(prefix)} == {prefix + "x", prefix + "switch"}
    assert not [n for n in netns.list_netns() if n.startswith(prefix)]
