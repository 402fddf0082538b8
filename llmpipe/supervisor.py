"""Runs a set of child processes with per-child log files and a prefixed console view,
and shuts them down warm (SIGTERM), or forced (SIGKILL) on a second Ctrl-C."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

_COLORS = ["cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta"]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    # If the supervisor itself is killed, the kernel sends SIGTERM to its children, so
    # no orphan outlives `llmpipe up`.
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    os.setsid()


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | None = None
    color: str = "white"
    tail: list[str] = field(default_factory=list)


class Supervisor:
    def __init__(self, log_dir: Path, console: Console | None = None, echo: bool = True):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.console = console or Console(stderr=True, highlight=False)
        self.echo = echo
        self.children: list[Child] = []
        self._threads: list[threading.Thread] = []

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> Child:
        child = Child(name, argv, env, self.log_dir / f"{name}.log", color=_COLORS[len(self.children) % len(_COLORS)])
        child.proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent, text=True, bufsize=1, errors="replace",
        )
        t = threading.Thread(target=self._pump, args=(child,), daemon=True, name=f"log-{name}")
        t.start()
        self._threads.append(t)
        self.children.append(child)
        return child

    def _pump(self, child: Child) -> None:
        assert child.proc and child.proc.stdout
        width = max(12, *(len(c.name) for c in self.children)) if self.children else 12
        with child.log_path.open("a", buffering=1) as log:
            for line in child.proc.stdout:
                log.write(line)
                child.tail = (child.tail + [line.rstrip()])[-40:]
                if self.echo:
                    self.console.print(f"[{child.color}]{child.name:<{width}}|[/] {line.rstrip()}", markup=True,
                                       highlight=False, soft_wrap=True, emoji=False)

    def exited(self) -> list[Child]:
        return [c for c in self.children if c.proc and c.proc.poll() is not None]

    def _signal_all(self, sig: int) -> None:
        for c in self.children:
            if c.proc and c.proc.poll() is None:
                try:
                    if sig == signal.SIGKILL:
                        os.killpg(c.proc.pid, sig)  # the whole group, prefork children included
                    else:
                        # Only the main process: Celery's warm shutdown lets its pool
                        # children finish their tasks before it stops them.
                        c.proc.send_signal(sig)
                except ProcessLookupError:
                    pass

    def stop(self, timeout: float = 60.0, force_event: threading.Event | None = None) -> None:
        """Warm shutdown: SIGTERM everyone, wait; SIGKILL what remains at timeout or when
        ``force_event`` is set (a second Ctrl-C)."""
        self._signal_all(signal.SIGTERM)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if all(c.proc is None or c.proc.poll() is not None for c in self.children):
                break
            if force_event is not None and force_event.is_set():
                break
            time.sleep(0.1)
        self._signal_all(signal.SIGKILL)
        for c in self.children:
            if c.proc:
                try:
                    c.proc.wait(5)
                except subprocess.TimeoutExpired:
                    pass
                # Reap anything left in the child's process group (e.g. a prefork child).
                try:
                    os.killpg(c.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for t in self._threads:
            t.join(timeout=2)


def python_env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # Children must find celeryconfig and the tasks package from the project root.
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


__all__ = ["Supervisor", "Child", "python_env", "sys"]
