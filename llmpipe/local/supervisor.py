"""Runs a set of child processes with per-child log files and a prefixed console view,
restarts those that exit on their own (with a RestartPolicy, llmpipe/local/restarts.py), and
shuts them down warm (SIGTERM), or forced (SIGKILL) on a second Ctrl-C.

No child outlives the supervisor: each child runs in its own process group (so a
terminal's Ctrl-C reaches only the supervisor, which decides), every group is killed
at the end (grandchildren included), and PR_SET_PDEATHSIG makes the kernel send
SIGTERM to the children should the supervisor itself die (even by SIGKILL).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.text import Text

from llmpipe.local.console_filter import LevelFilter
from llmpipe.local.restarts import Decision, RestartPolicy

_COLORS = ["cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta"]
_PR_SET_PDEATHSIG = 1


_PRCTL: list = []


def _prctl():
    if not _PRCTL:
        try:
            _PRCTL.append(ctypes.CDLL(None, use_errno=True).prctl)
        except (OSError, AttributeError):  # not Linux
            _PRCTL.append(None)
    return _PRCTL[0]


def die_with_parent(sig: int = signal.SIGTERM, new_session: bool = True):
    """A ``preexec_fn``: the child gets ``sig`` when this (forking) process dies, and runs
    in a session of its own (away from the terminal's Ctrl-C). The kernel ties the signal
    to the *thread* that forks, so spawn from a thread that lives as long as the children
    (the main thread)."""
    parent = os.getpid()
    prctl = _prctl()  # looked up here: after a fork in a threaded process, only call it

    def preexec() -> None:  # pragma: no cover - runs in the child before exec
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)
        if new_session:
            os.setsid()

    return preexec


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | None = None
    color: str = "white"
    tail: list[str] = field(default_factory=list)
    restarts: int = 0
    policy: RestartPolicy | None = None  # None: an exit is left for the caller to handle
    started_at: float = 0.0  # clock time of the last (re)start
    restart_at: float | None = None  # clock time of a restart that is due
    ever_ready: bool = False  # set by the owner once the child has served
    given_up: bool = False  # crashed too often: stays down

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def how_exited(returncode: int | None) -> str:
    """``was killed by SIGKILL`` or ``exited with code 70``."""
    if returncode is not None and returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


@dataclass(frozen=True)
class Crash:
    """A supervised child exited on its own, ``uptime_s`` after its start."""

    child: Child
    returncode: int | None
    uptime_s: float
    decision: Decision


class Supervisor:
    def __init__(self, log_dir: Path, console: Console | None = None, echo: bool = True, width: int = 12,
                 echo_level: int = logging.DEBUG, clock=time.monotonic):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.console = console or Console(stderr=True, highlight=False)
        self.echo = echo
        self.echo_level = echo_level  # the console shows a child's lines from this level up
        self.width = width
        self.children: list[Child] = []
        self._threads: list[threading.Thread] = []
        self.clock = clock
        self._stopping = False
        # Called with each child as soon as it is exec'd (Popen returned), so that the threads and
        # processes it starts later inherit what is set on it here (llmpipe/local/placement.py).
        self.on_start: Callable[[Child], None] | None = None

    def spawn(self, name: str, argv: list[str], env: dict[str, str], policy: RestartPolicy | None = None) -> Child:
        """Start a child. With a ``policy``, ``tend`` restarts it whenever it exits on its own."""
        child = Child(name, argv, env, self.log_dir / f"{name}.log", color=_COLORS[len(self.children) % len(_COLORS)],
                      policy=policy)
        self.width = max(self.width, len(name))
        self.children.append(child)
        self._start(child)
        return child

    def respawn(self, child: Child) -> Child:
        """Start ``child``'s command again in its place (same name, log file and colour)."""
        self._start(child)
        child.restarts += 1
        return child

    def _start(self, child: Child) -> None:
        child.proc = subprocess.Popen(
            child.argv, env=child.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent(), text=True, bufsize=1, errors="replace",
        )
        child.tail = []  # what the last run said, not an earlier one
        child.restart_at = None
        child.started_at = self.clock()
        if self.on_start is not None:
            self.on_start(child)
        if child.policy is not None:
            child.policy.started(child.started_at)
        t = threading.Thread(target=self._pump, args=(child, child.proc), daemon=True, name=f"log-{child.name}")
        t.start()
        self._threads.append(t)

    def tend(self, now: float | None = None) -> list[Crash]:
        """One round of supervision (call it often): a supervised child that exited on its
        own gets its process group killed (its pool processes, its engine process) and a
        restart scheduled after its policy's delay; a restart that is due happens. Returns
        the crashes seen this round, those given up on included (their child stays down).
        Does nothing once ``stop`` has begun."""
        if now is None:
            now = self.clock()
        crashes: list[Crash] = []
        for c in self.children:
            if self._stopping:
                break
            if c.policy is None or c.proc is None or c.proc.poll() is None:
                continue
            if c.restart_at is not None:
                if now >= c.restart_at:
                    self.respawn(c)
                continue
            if c.given_up:
                continue
            self._kill_group(c)
            decision = c.policy.crashed(now)
            crashes.append(Crash(c, c.proc.returncode, now - c.started_at, decision))
            if decision.give_up:
                c.given_up = True
            else:
                c.restart_at = now + decision.delay_s
        return crashes

    @staticmethod
    def _kill_group(c: Child) -> None:
        # Whatever the dead child left in its group (pool processes, vLLM's engine core)
        # must not hold memory, a GPU or queue messages next to its replacement.
        try:
            os.killpg(c.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def _pump(self, child: Child, proc: subprocess.Popen) -> None:
        """Copies the output of one run (``proc``) of the child to its log file and,
        prefixed, to the console. It never stops reading before the run closes its output,
        so a child never blocks on a full pipe."""
        assert proc.stdout
        levels = LevelFilter(self.echo_level)
        with child.log_path.open("a", buffering=1) as log, proc.stdout:
            for line in proc.stdout:
                line = line.rstrip("\n")
                try:
                    log.write(line + "\n")
                except OSError:
                    pass
                if child.proc is proc:  # a late line of an earlier run is not the current one's
                    child.tail = (child.tail + [line])[-40:]
                if self.echo and levels.show(line):
                    try:
                        self.console.print(Text.assemble((f"{child.name:<{self.width}}| ", child.color), line),
                                           soft_wrap=True, highlight=False)
                    except Exception:  # the console view must never stop the copy
                        pass

    def exited(self) -> list[Child]:
        return [c for c in self.children if c.proc and c.proc.poll() is not None]

    def get(self, name: str) -> Child | None:
        return next((c for c in self.children if c.name == name), None)

    def _signal(self, children: Iterable[Child], sig: int) -> None:
        for c in children:
            if not c.running:
                continue
            try:
                if sig == signal.SIGKILL:
                    os.killpg(c.proc.pid, sig)  # the whole group, pool children included
                else:
                    # Only the main process: Celery's warm shutdown lets its pool children
                    # finish their tasks before it stops them.
                    c.proc.send_signal(sig)
            except (ProcessLookupError, PermissionError):
                pass

    def stop(self, timeout: float = 60.0, force_event: threading.Event | None = None,
             order: Sequence[Sequence[str]] | None = None) -> bool:
        """Warm shutdown: SIGTERM the children stage by stage (``order`` lists stages of
        child names; children not named form a last stage), waiting for each stage to
        exit; SIGKILL whatever remains at ``timeout`` or once ``force_event`` is set (a
        second Ctrl-C). Returns True when everything stopped warm. No restart happens
        once it has begun."""
        self._stopping = True
        named = {n for stage in (order or []) for n in stage}
        stages = [[c for c in self.children if c.name in stage] for stage in (order or [])]
        stages.append([c for c in self.children if c.name not in named])
        end = time.monotonic() + timeout
        warm = True
        for stage in stages:
            self._signal(stage, signal.SIGTERM)
            while any(c.running for c in stage):
                if time.monotonic() >= end or (force_event is not None and force_event.is_set()):
                    warm = False
                    break
                time.sleep(0.05)
            if not warm:
                break
        self._signal(self.children, signal.SIGKILL)
        for c in self.children:
            if c.proc is None:
                continue
            try:
                c.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
            # Anything left in the child's process group (a pool child, an engine process).
            try:
                os.killpg(c.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for t in self._threads:
            t.join(timeout=2)
        return warm


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) from /proc/PID/stat, or None when there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the command may hold spaces and parens
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (dead, waiting to be reaped)."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` now (children, grandchildren, ...), from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                parents.setdefault(st[1], []).append(int(entry))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def python_env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # Children must find celeryconfig and the tasks package from the project root.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


__all__ = ["Supervisor", "Child", "Crash", "alive", "descendants", "die_with_parent", "how_exited", "python_env"]
