"""CPU use per stage (process trees sampled with psutil) and Redis traffic per request
(``INFO commandstats`` / ``INFO stats`` deltas)."""

from __future__ import annotations

import os
import threading
import time

import psutil


def _cpu_s(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


class CpuSampler:
    """CPU seconds used by named groups of process trees over a window.

    ``groups`` maps a name (a pipeline stage, "redis", "loadgen") to root pids; every
    descendant counts for its root's group (prefork children, vLLM's engine core). The
    trees are sampled every ``interval`` s, so CPU of a process that exits in the window
    is counted up to its last sample. ``other`` is what the rest of the machine used in the
    same window (other users' tests, the bench's own bookkeeping, the kernel).
    """

    def __init__(self, groups: dict[str, list[int]], interval: float = 0.5, flat: tuple[str, ...] = ("loadgen",)):
        self.groups = groups
        self.flat = set(flat)  # groups counted without their children
        self.interval = interval
        self._base: dict[int, float] = {}
        self._last: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._sys0 = None

    def _sample(self, first: bool = False) -> None:
        for name, pids in self.groups.items():
            for pid in pids:
                try:
                    root = psutil.Process(pid)
                    procs = [root] if name in self.flat else [root, *root.children(recursive=True)]
                except psutil.Error:
                    continue
                for p in procs:
                    try:
                        total = _cpu_s(p)
                        if p.pid not in self._base:
                            # Present at the start: count from here; born later: count it all.
                            self._base[p.pid] = total if first or p.create_time() < self._t0 else 0.0
                        self._last[p.pid] = (name, total)
                    except psutil.Error:
                        continue

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def start(self) -> CpuSampler:
        self._t0 = time.time()
        self._sys0 = psutil.cpu_times()
        self._sample(first=True)
        self._thread = threading.Thread(target=self._run, name="bench-cpu", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        self._sample()
        wall = max(time.time() - self._t0, 1e-9)
        sys1 = psutil.cpu_times()
        busy = lambda t: sum(t) - t.idle - getattr(t, "iowait", 0.0)  # noqa: E731
        per: dict[str, float] = {name: 0.0 for name in self.groups}
        for pid, (name, total) in self._last.items():
            per[name] += max(0.0, total - self._base.get(pid, total))
        system = max(0.0, busy(sys1) - busy(self._sys0))
        return {
            "wall_s": wall,
            "cores": psutil.cpu_count() or 1,
            "cpu_s": per,
            "system_cpu_s": system,
            "other_cpu_s": max(0.0, system - sum(per.values())),
        }


def redis_snapshot(client) -> dict:
    cmds = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in client.info("commandstats").items()}
    st = client.info("stats")
    return {"commands": cmds, "total": int(st["total_commands_processed"]),
            "net_in": int(st["total_net_input_bytes"]), "net_out": int(st["total_net_output_bytes"])}


def redis_delta(before: dict, after: dict, requests: int) -> dict:
    n = max(1, requests)
    cmds = {k: v - before["commands"].get(k, 0) for k, v in after["commands"].items()}
    cmds = {k: v for k, v in sorted(cmds.items(), key=lambda kv: -kv[1]) if v > 0}
    return {
        "commands_per_request": (after["total"] - before["total"]) / n,
        "by_command_per_request": {k: round(v / n, 2) for k, v in cmds.items()},
        "bytes_in_per_request": (after["net_in"] - before["net_in"]) / n,
        "bytes_out_per_request": (after["net_out"] - before["net_out"]) / n,
        "note": "all Redis traffic in the window (broker, result backend, job store, pub/sub, "
                "worker events and heartbeats) divided by the requests sent",
    }


def self_pid() -> int:
    return os.getpid()
