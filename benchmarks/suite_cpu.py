"""Where the test suite's CPU goes: runs a command (default ``make test``) under the kernel's
process accounting and charges the CPU of every process that exits meanwhile (user and
system, from its exit record) to the test module that its pytest-xdist worker was running
when the process started.

On 2 cores the full run is bound by CPU (docs/operations.md, "Tests"), and pytest's
durations report shows wall time, which a test shares with everything running beside it.
Accounting also sees what runs outside the test processes: the run's controller and what it
starts (dockerd, the Compose images' build: pip, dpkg), and processes whose parent died
first (the kernel gives them to init). Needs root and Debian's ``acct`` package (accton,
dump-acct).

    python -m benchmarks.suite_cpu --out suite-cpu.json [-- make test PYTEST_ARGS=-x]

Prints a table per module and writes it, with the totals, as JSON.
"""

from __future__ import annotations

import argparse
import bisect
import calendar
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

WORKER_TITLE = "[pytest-xdist running] "  # a pytest-xdist worker's process title, then the test's node id
OUTSIDE = "(outside the test workers)"
WORKERS = "(the test workers themselves)"
EARLY = "(a test worker, before its first sample)"
# A process started this much before its worker was first seen in a test is not that test's.
EARLY_S = 60.0
# Linux writes acct v3 records in AHZ units, 100 a second (kernel/acct.c).
TICKS_PER_S = 100.0
# A process that spent this much most likely imported torch and vLLM: a bare import of
# torch costs about 4 s of CPU on these VMs, vLLM's engine core 9-10 s.
HEAVY_CPU_S = 8.0


@dataclass(frozen=True)
class Exit:
    """One process's accounting record: written when it exits."""

    comm: str
    cpu_s: float
    pid: int
    ppid: int  # 1 when its parent died first
    started: float  # epoch seconds, whole
    elapsed_s: float

    @property
    def ended(self) -> float:
        return self.started + self.elapsed_s


def parse_dump(text: str) -> list[Exit]:
    """dump-acct's lines: comm|version|utime|stime|etime|uid|gid|mem|io|pid|ppid|flags|exit|tty|start."""
    out = []
    for line in text.splitlines():
        f = [x.strip() for x in line.split("|")]
        if len(f) < 15:
            continue
        started = calendar.timegm(time.strptime(f[14], "%a %b %d %H:%M:%S %Y"))
        out.append(Exit(f[0], (float(f[2]) + float(f[3])) / TICKS_PER_S, int(f[9]), int(f[10]), float(started),
                        float(f[4]) / TICKS_PER_S))
    return out


@dataclass(frozen=True)
class Sample:
    """A test worker seen running a test: (when, its pid, the test's module)."""

    at: float
    pid: int
    module: str


def module_of(title: str) -> str | None:
    if not title.startswith(WORKER_TITLE):
        return None
    return title[len(WORKER_TITLE):].split("::", 1)[0].strip()


def _proc_table(proc: Path = Path("/proc")) -> tuple[dict[int, str], dict[int, int]]:
    """Each live process's title (its cmdline, which setproctitle rewrites) and parent."""
    titles, parents = {}, {}
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            titles[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            stat = (d / "stat").read_text()
            parents[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # it exited meanwhile
    return titles, parents


class Sampler:
    """Reads /proc every ``every_s`` on a thread: which test each worker runs, and every
    live process's parent (kept for those whose accounting record will name init instead)."""

    def __init__(self, every_s: float = 1.0, read: Callable[[], tuple[dict[int, str], dict[int, int]]] = _proc_table):
        self.every_s = every_s
        self.read = read
        self.samples: list[Sample] = []
        self.parents: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="suite-cpu-sampler", daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample(time.time())
            self._stop.wait(self.every_s)

    def sample(self, now: float) -> None:
        titles, parents = self.read()
        for pid, parent in parents.items():
            if parent != 1:  # not yet given to init; a reused pid takes its new parent
                self.parents[pid] = parent
        for pid, title in titles.items():
            module = module_of(title)
            if module is not None:
                self.samples.append(Sample(now, pid, module))


def attribute(exits: Iterable[Exit], samples: list[Sample], parents: dict[int, int]) -> dict[str, dict]:
    """CPU seconds, process count and heaviest commands per module. A process counts for the
    module its worker ran at the process's start (the last sample before it, else the first
    after); one with no worker among its ancestors counts as OUTSIDE, the workers as WORKERS.
    ``parents``: parents seen live, for processes whose record names init."""
    exits = list(exits)
    lives: dict[int, list[Exit]] = defaultdict(list)  # pid -> its processes, by end (pids are reused)
    for e in sorted(exits, key=lambda e: e.ended):
        lives[e.pid].append(e)
    by_worker: dict[int, list[Sample]] = defaultdict(list)
    for s in sorted(samples, key=lambda s: s.at):
        by_worker[s.pid].append(s)
    starts = {w: [s.at for s in seen] for w, seen in by_worker.items()}

    def parent_at(pid: int, at: float) -> int | None:
        """The parent of the process that had ``pid`` at time ``at``."""
        for e in lives.get(pid, ()):
            if e.ended >= at - 1.0 and e.started <= at + 1.0:
                return e.ppid if e.ppid != 1 else parents.get(pid)
        return parents.get(pid)

    def worker_of(e: Exit) -> int | None:
        pid = e.ppid if e.ppid != 1 else parents.get(e.pid)
        for _ in range(64):  # deeper than this: a loop through reused pids
            if pid is None or pid <= 1:
                return None
            if pid in by_worker:
                return pid
            pid = parent_at(pid, e.started)
        return None

    def module_at(worker: int, at: float) -> str:
        i = bisect.bisect_right(starts[worker], at + 1.0)  # the record's start is whole seconds
        if i == 0 and starts[worker][0] - at > EARLY_S:
            return EARLY
        return by_worker[worker][max(i - 1, 0)].module

    table: dict[str, dict] = defaultdict(lambda: {"cpu_s": 0.0, "processes": 0, "heavy": 0, "commands": Counter()})
    for e in exits:
        if e.pid in by_worker and e.comm.startswith("[pytest-xdist"):  # running or idle, as it exits
            key = WORKERS
        else:
            worker = worker_of(e)
            key = OUTSIDE if worker is None else module_at(worker, e.started)
        row = table[key]
        row["cpu_s"] += e.cpu_s
        row["processes"] += 1
        row["heavy"] += e.cpu_s >= HEAVY_CPU_S
        row["commands"][e.comm] += e.cpu_s
    return dict(table)


def report(table: dict[str, dict], wall_s: float | None, cores: int) -> dict:
    rows = sorted(({"module": k, "cpu_s": round(v["cpu_s"], 1), "processes": v["processes"], "heavy": v["heavy"],
                    "top": {c: round(s, 1) for c, s in v["commands"].most_common(4)}} for k, v in table.items()),
                  key=lambda r: -r["cpu_s"])
    total = sum(r["cpu_s"] for r in rows)
    return {"cpu_s": round(total, 1), "wall_s": wall_s, "cores": cores,
            "busy": round(total / (wall_s * cores), 3) if wall_s else None,
            "floor_s": round(total / cores, 1), "heavy_processes": sum(r["heavy"] for r in rows), "modules": rows}


def markdown(rep: dict, top: int = 30) -> str:
    wall = f", and the run took {rep['wall_s']:.0f} s ({rep['busy']:.0%} busy)" if rep["wall_s"] else ""
    lines = [f"{rep['cpu_s']:.0f} CPU-s in all; {rep['heavy_processes']} processes used over {HEAVY_CPU_S:g} CPU-s "
             f"each (most of them import torch and vLLM); at full use of {rep['cores']} cores that is "
             f"{rep['floor_s']:.0f} s of wall{wall}",
             "", "| module | CPU-s | processes | over 8 CPU-s | heaviest commands |", "|---|---|---|---|---|"]
    for r in rep["modules"][:top]:
        cmds = ", ".join(f"{c} {s:.0f}" for c, s in r["top"].items())
        lines.append(f"| {r['module']} | {r['cpu_s']:.0f} | {r['processes']} | {r['heavy']} | {cmds} |")
    return "\n".join(lines)


def _tools() -> None:
    if os.geteuid() != 0:
        sys.exit("suite_cpu: process accounting needs root")
    missing = [t for t in ("accton", "dump-acct") if shutil.which(t) is None]
    if missing:
        sys.exit(f"suite_cpu: {', '.join(missing)} not found: apt-get install acct")


def run(command: list[str], every_s: float) -> tuple[dict, float]:
    _tools()
    with tempfile.TemporaryDirectory(prefix="suite-cpu-") as tmp:
        pacct = Path(tmp) / "pacct"
        pacct.touch()
        subprocess.run(["accton", str(pacct)], check=True, capture_output=True)
        sampler = Sampler(every_s).start()
        t0 = time.monotonic()
        try:
            rc = subprocess.run(command).returncode
        finally:
            wall_s = time.monotonic() - t0
            sampler.stop()
            subprocess.run(["accton", "off"], capture_output=True)
        exits = parse_dump(subprocess.run(["dump-acct", str(pacct)], capture_output=True, text=True, check=True).stdout)
    print(f"suite_cpu: {' '.join(command)} exited {rc} after {wall_s:.0f} s", file=sys.stderr)
    return attribute(exits, sampler.samples, sampler.parents), wall_s


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, command = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(prog="python -m benchmarks.suite_cpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("suite-cpu.json"))
    p.add_argument("--every-s", type=float, default=1.0, help="how often /proc is read for the workers' tests")
    args = p.parse_args(ours)
    table, wall_s = run(command or ["make", "test"], args.every_s)
    rep = report(table, wall_s, os.cpu_count() or 1)
    args.out.write_text(json.dumps(rep, indent=1))
    print(markdown(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
