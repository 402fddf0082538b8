"""A Redis Sentinel group laid out over hosts: a master, its replicas and the sentinels
that watch them, each on its own host, for failover tests.

    group = SentinelGroup(hosts, master="redis1", replicas=("redis2",),
                          sentinels=("sent1", "sent2", "sent3")).start()
    settings = Settings(redis_url=group.url, ...)   # sentinel://10.231.0.4:26379/0;...
    hosts.kill_host("redis1")                       # kill -9 the master
    group.wait_promoted("client", old=group.initial_master)

Each sentinel gets a generated config (``sentinel monitor``) in the log folder, which it
rewrites as it learns the group. Clients reach the sentinels and the master directly:
Sentinel hands out the servers' own addresses, so no delaying proxy can sit on that path.

``down_after_ms`` and ``failover_timeout_ms`` default to test timings (a master silent for
1 s is down); production ones are tens of seconds (docs/deploy.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis

from llmpipe.testing.hosts.harness import Hosts

REDIS_PORT = 6379
SENTINEL_PORT = 26379


@dataclass
class SentinelGroup:
    hosts: Hosts
    master: str
    replicas: tuple[str, ...]
    sentinels: tuple[str, ...]
    name: str = "mymaster"
    quorum: int = 2
    down_after_ms: int = 1000
    failover_timeout_ms: int = 5000
    redis_args: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        return ";".join(f"sentinel://{self.hosts.addr(s)}:{SENTINEL_PORT}/0" for s in self.sentinels)

    @property
    def initial_master(self) -> tuple[str, int]:
        return self.hosts.addr(self.master), REDIS_PORT

    def host_of(self, address: tuple[str, int]) -> str | None:
        return next((h for h in (self.master, *self.replicas) if self.hosts.addr(h) == address[0]), None)

    def config(self) -> str:
        ip, port = self.initial_master
        return "\n".join([
            f"sentinel monitor {self.name} {ip} {port} {self.quorum}",
            f"sentinel down-after-milliseconds {self.name} {self.down_after_ms}",
            f"sentinel failover-timeout {self.name} {self.failover_timeout_ms}",
            f"sentinel parallel-syncs {self.name} 1",
            "",
        ])

    def start(self, timeout: float = 60.0) -> SentinelGroup:
        for h in (self.master, *self.replicas, *self.sentinels):
            if h not in self.hosts.hosts:
                self.hosts.add(h)
        ip, port = self.initial_master
        self.hosts.start_redis(self.master, port=port, args=self.redis_args)
        for r in self.replicas:
            self.hosts.start_redis(r, port=port, args=("--replicaof", ip, str(port), *self.redis_args))
        for s in self.sentinels:
            conf = self.hosts.log_dir / f"{s}.sentinel.conf"  # the sentinel rewrites it: one each
            conf.write_text(self.config())
            self.hosts.start_redis(s, port=SENTINEL_PORT, conf=conf, args=("--sentinel",), name="sentinel")
        self._wait_formed(timeout)
        return self

    def _wait_formed(self, timeout: float) -> None:
        """Until every replica is in sync and every sentinel knows every replica and every
        other sentinel: before that, a dead master may never be failed over."""
        want_replicas, want_others = len(self.replicas), len(self.sentinels) - 1
        end = time.monotonic() + timeout
        seen: dict = {}
        while time.monotonic() < end:
            seen = {s: self._sentinel_view(s) for s in self.sentinels}
            seen.update({r: self._replica_link(r) for r in self.replicas})
            if all(v == (want_replicas, want_others) for s, v in seen.items() if s in self.sentinels) and \
                    all(seen[r] == "up" for r in self.replicas):
                return
            time.sleep(0.2)
        raise TimeoutError(f"the Sentinel group did not form in {timeout:.0f}s: {seen} "
                           f"(want {want_replicas} replicas, {want_others} other sentinels; logs in {self.hosts.log_dir})")

    def _sentinel_view(self, s: str) -> tuple[int, int] | str:
        def ask():
            with redis.Redis(self.hosts.addr(s), SENTINEL_PORT, socket_timeout=2, socket_connect_timeout=2) as c:
                m = c.sentinel_master(self.name)
                return int(m["num-slaves"]), int(m["num-other-sentinels"])

        try:
            return self.hosts.call(s, ask)
        except redis.RedisError as e:
            return f"{type(e).__name__}: {e}"

    def _replica_link(self, r: str) -> str:
        def ask():
            with redis.Redis(self.hosts.addr(r), REDIS_PORT, socket_timeout=2, socket_connect_timeout=2) as c:
                return c.info("replication").get("master_link_status", "?")

        try:
            return self.hosts.call(r, ask)
        except redis.RedisError as e:
            return f"{type(e).__name__}: {e}"

    def masters(self, via: str) -> dict[str, tuple[str, int] | None]:
        """The master each sentinel names, asked from ``via``; None where one does not answer."""
        def ask():
            out: dict[str, tuple[str, int] | None] = {}
            for s in self.sentinels:
                try:
                    with redis.Redis(self.hosts.addr(s), SENTINEL_PORT, socket_timeout=1, socket_connect_timeout=1) as c:
                        addr = c.sentinel_get_master_addr_by_name(self.name)
                except redis.RedisError:
                    addr = None
                out[s] = (addr[0].decode() if isinstance(addr[0], bytes) else addr[0], int(addr[1])) if addr else None
            return out

        return self.hosts.call(via, ask)

    def wait_promoted(self, via: str, old: tuple[str, int], timeout: float = 60.0,
                      every: float = 0.02) -> tuple[tuple[str, int], float]:
        """Until a sentinel names a master other than ``old`` (a client takes the first
        sentinel's answer: the others learn of the promotion later). Returns the new master
        and the wall-clock time when the sentinels were last seen all naming no other: the
        promotion came after it."""
        end = time.monotonic() + timeout
        last = time.time()
        while time.monotonic() < end:
            t = time.time()
            new = [a for a in self.masters(via).values() if a is not None and a != old]
            if new:
                return new[0], last
            last = t
            time.sleep(every)
        raise TimeoutError(f"no replica was promoted in {timeout:.0f}s (logs in {self.hosts.log_dir})")
