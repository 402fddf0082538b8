"""The llmpipe pipeline laid out over hosts: Redis on one, the API on another, the CPU
workers on a third, each inference worker on its own, and a client host for the load.

Every process that talks to another host goes through a delaying proxy in its own host
(:meth:`Hosts.route`): the workers and the API reach Redis that way, the client reaches
the API that way. On a one-host layout every role shares one host and no proxy sits
anywhere; processes still talk over the host's veth address, not loopback.
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from llmpipe.local.pipeline import settings_env
from llmpipe.local.supervisor import Child
from llmpipe.settings import Settings
from llmpipe.testing.hosts.harness import Hosts

API_PORT = 8000
REDIS_PORT = 6379


@dataclass(frozen=True)
class Placement:
    """Which host each role runs on."""

    redis: str
    api: str
    cpu: str  # preprocess and postprocess (which also serves collect)
    inference: tuple[str, ...]  # one per inference worker, in start order
    client: str

    @property
    def names(self) -> list[str]:
        return list(dict.fromkeys([self.redis, self.api, self.cpu, *self.inference, self.client]))

    @classmethod
    def spread(cls, inference_workers: int) -> Placement:
        return cls("redis", "api", "cpu", tuple(f"gpu{i + 1}" for i in range(inference_workers)), "client")

    @classmethod
    def one_host(cls, inference_workers: int = 1) -> Placement:
        return cls("solo", "solo", "solo", ("solo",) * inference_workers, "solo")


@dataclass
class HostsPipeline:
    settings: Settings
    hosts: Hosts
    placement: Placement
    extra_env: dict[str, str] = field(default_factory=dict)
    # Celery workers per CPU stage, each a pool of settings.cpu_workers processes: one
    # worker's main process fetches, acks and reports every task, one Redis round trip
    # after another, so far from Redis it caps a stage whatever its pool size.
    cpu_instances: int = 1
    # A Redis the caller started (a Sentinel group, llmpipe/hosts/sentinel.py): every host
    # uses this URL as it is, and no Redis is started here.
    redis_url: str | None = None
    inference: list[Child] = field(default_factory=list)
    roles: dict[str, list[Child]] = field(default_factory=dict)

    def _reach(self, src: str, dst: str, port: int) -> str:
        """``address:port`` of ``dst:port`` as ``src`` reaches it: directly on one host,
        through ``src``'s delaying proxy otherwise."""
        if src == dst:
            return f"{self.hosts.addr(dst)}:{port}"
        return self.hosts.route(src, dst, port)

    def redis_url_from(self, host: str) -> str:
        if self.redis_url is not None:
            return self.redis_url
        return f"redis://{self._reach(host, self.placement.redis, REDIS_PORT)}/0"

    @property
    def control_redis_url(self) -> str:
        """For the harness's own reads from the client host (pings, queue depths): direct
        to Redis, so that its bookkeeping is never delayed and never slows the proxies."""
        if self.redis_url is not None:
            return self.redis_url
        return f"redis://{self.hosts.addr(self.placement.redis)}:{REDIS_PORT}/0"

    @property
    def api_url(self) -> str:
        """The API as the client host reaches it."""
        return f"http://{self._reach(self.placement.client, self.placement.api, API_PORT)}"

    def metrics_dir(self, host: str) -> Path:
        return Path(self.settings.state_dir) / "metrics" / host

    def _env(self, host: str, kind: str | None = None) -> dict[str, str]:
        d = self.metrics_dir(host)
        d.mkdir(parents=True, exist_ok=True)
        env = {**settings_env(self.settings), "LLMPIPE_REDIS_URL": self.redis_url_from(host),
               "PROMETHEUS_MULTIPROC_DIR": str(d), **self.extra_env}
        if kind:
            env["LLMPIPE_WORKER_KIND"] = kind
        return env

    def _worker(self, host: str, kind: str, node: str) -> Child:
        from workers.launch import worker_argv

        child = self.hosts.spawn(host, node.split("@")[0], worker_argv(kind, self.settings, name=node),
                                 self._env(host, kind))
        self.roles.setdefault(kind, []).append(child)
        return child

    def start(self, inference_workers: int = 1) -> HostsPipeline:
        p = self.placement
        shutil.rmtree(Path(self.settings.state_dir) / "metrics", ignore_errors=True)
        for name in p.names:
            if name not in self.hosts.hosts:
                self.hosts.add(name)
        if self.redis_url is None:
            self.hosts.start_redis(p.redis, port=REDIS_PORT)
        for kind in ("preprocess", "postprocess"):
            for i in range(self.cpu_instances):
                self._worker(p.cpu, kind, f"{kind}-{i + 1}@{p.cpu}" if self.cpu_instances > 1 else f"{kind}@{p.cpu}")
        api = self.hosts.spawn(p.api, "api", [sys.executable, "-m", "llmpipe.cli", "api", "--host",
                                              self.hosts.addr(p.api), "--port", str(API_PORT)], self._env(p.api))
        self.roles["api"] = [api]
        self.scale_inference(inference_workers)
        return self

    def scale_inference(self, n: int) -> None:
        """Start inference workers until ``n`` run (never stops any)."""
        if n > len(self.placement.inference):
            raise ValueError(f"the placement has {len(self.placement.inference)} inference hosts, not {n}")
        while len(self.inference) < n:
            i = len(self.inference) + 1
            self.inference.append(self._worker(self.placement.inference[i - 1], "inference", f"inference-{i}@llmpipe"))

    @property
    def worker_names(self) -> set[str]:
        return {c.name.split(".", 1)[1] for kind in ("preprocess", "postprocess", "inference")
                for c in self.roles.get(kind, [])}

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Until every worker answers a ping (from the client host) and the API's
        /healthz answers 200 through the client's path to it."""
        self.hosts.call(self.placement.client, self._wait_ready, self.api_url, timeout)

    def _wait_ready(self, api_url: str, timeout: float) -> None:
        from llmpipe.broker.redis_clients import celery_probe

        probe = celery_probe(self.control_redis_url, master_name=self.settings.redis_sentinel_master)
        end = time.monotonic() + timeout
        missing: list[str] = []
        try:
            while time.monotonic() < end:
                dead = self.hosts.sup.exited()
                if dead:
                    last = next((ln for ln in reversed(dead[0].tail) if ln.strip()), "")
                    raise RuntimeError(f"{dead[0].name} exited with code {dead[0].proc.returncode}: {last[:300]} "
                                       f"(log: {dead[0].log_path})")
                try:
                    replies = probe.control.ping(timeout=0.5) or []
                except Exception:  # Redis still starting
                    replies = []
                seen = {name.split("@")[0] for r in replies for name in r}
                missing = sorted(self.worker_names - seen)
                try:
                    api_ok = httpx.get(f"{api_url}/healthz", timeout=2).status_code == 200
                except httpx.HTTPError:
                    api_ok = False
                if not missing and api_ok:
                    return
                missing += [] if api_ok else ["api"]
                time.sleep(0.3)
        finally:
            probe.close()
        raise TimeoutError(f"not ready after {timeout:.0f}s, waiting for {missing}; logs in {self.hosts.log_dir}")

    def batch_totals(self) -> dict[str, tuple[float, float]]:
        """Per inference worker: (requests, batches) so far, from the
        ``llmpipe_batch_size_requests`` histogram in its host's metrics folder."""
        from prometheus_client import CollectorRegistry
        from prometheus_client.multiprocess import MultiProcessCollector

        out = {}
        for i, host in enumerate(self.placement.inference[: len(self.inference)]):
            reg = CollectorRegistry()
            MultiProcessCollector(reg, path=str(self.metrics_dir(host)))
            total = count = 0.0
            for metric in reg.collect():
                if metric.name == "llmpipe_batch_size_requests":
                    for s in metric.samples:
                        if s.name.endswith("_sum"):
                            total += s.value
                        elif s.name.endswith("_count"):
                            count += s.value
            out[f"inference-{i + 1}"] = (total, count)
        return out

    def cpu_groups(self) -> dict[str, list[int]]:
        """Root pids of each role's processes, for :class:`llmpipe.bench.cpu.CpuSampler`."""
        groups = {kind: [c.proc.pid for c in children] for kind, children in self.roles.items() if kind != "inference"}
        for i, c in enumerate(self.inference):
            groups[f"inference-{i + 1}"] = [c.proc.pid]
        redis = [c.proc.pid for c in self.hosts.sup.children if c.name == f"{self.placement.redis}.redis"]
        groups["redis"] = redis
        if self.hosts.proxies:
            groups["proxies"] = [c.proc.pid for c in self.hosts.proxies]
        return groups
