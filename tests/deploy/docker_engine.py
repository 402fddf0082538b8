"""A Docker engine for the compose run (tests/deploy/test_compose_up.py): the one that
answers, or a dockerd started here, as root, after installing Debian's docker.io where it
is missing. What this module starts it stops."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

START_TIMEOUT_S = 60.0
INSTALL_TIMEOUT_S = 600.0


class EngineUnavailable(RuntimeError):
    """No Docker engine answers and none could be started here."""


def answers(timeout: float = 20.0) -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        r = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True,
                           text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0 and bool(r.stdout.strip())


def _install() -> None:
    if shutil.which("apt-get") is None:
        raise EngineUnavailable("no dockerd and no apt-get to install Debian's docker.io")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "docker.io"]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, env=env, check=False)
        if r.returncode != 0:
            raise EngineUnavailable(f"{' '.join(cmd)} failed: {r.stderr[-2000:]}")


def _clear_stale_pidfile(path: Path = Path("/var/run/docker.pid")) -> None:
    """A dockerd that died leaves its pid file, and a new one refuses to start over it."""
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError):
        return
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        path.unlink(missing_ok=True)


class Engine:
    """The engine the run uses; ``proc`` is set when this module started it."""

    def __init__(self, proc: subprocess.Popen | None = None, log: Path | None = None):
        self.proc = proc
        self.log = log

    @property
    def started_here(self) -> bool:
        return self.proc is not None

    def log_tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log and self.log.exists() else ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()  # dockerd stops its containers and containerd on SIGTERM
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def ensure(log_dir: Path) -> Engine:
    """The running engine, else dockerd started here (niced: the machine is shared)."""
    if answers():
        return Engine()
    if os.geteuid() != 0:
        raise EngineUnavailable("no Docker engine answers, and starting dockerd needs root")
    if shutil.which("dockerd") is None or shutil.which("docker") is None:
        _install()
    _clear_stale_pidfile()
    log = log_dir / "dockerd.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(["nice", "-n", "10", "dockerd"], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    engine = Engine(proc, log)
    end = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise EngineUnavailable(f"dockerd exited with {proc.returncode}:\n{engine.log_tail()}")
        if answers(timeout=5):
            return engine
        time.sleep(0.5)
    engine.stop()
    raise EngineUnavailable(f"dockerd did not answer within {START_TIMEOUT_S:.0f} s:\n{engine.log_tail()}")
