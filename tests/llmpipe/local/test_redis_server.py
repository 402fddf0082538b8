"""EmbeddedRedis: starts on a free loopback port, keeps an AOF that survives a restart,
stops cleanly, and never outlives the process that started it."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import redis

from llmpipe.local.redis_server import EmbeddedRedis, free_port, port_in_use, redis_answers
from llmpipe.local.supervisor import alive


def _wait_for(pred, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def test_start_aof_stop_and_restart(tmp_path):
    server = EmbeddedRedis(tmp_path / "redis").start()
    pid = server.proc.pid
    try:
        assert server.running and redis_answers(server.url)
        assert server.url.startswith("redis://127.0.0.1:")
        r = redis.Redis.from_url(server.url)
        r.rpush("queue", b"job-1", b"job-2")
        r.close()
        assert server.aof_path.is_file()
    finally:
        server.stop()
    assert not server.running and not alive(pid)
    assert not redis_answers(server.url, timeout=0.2)
    assert b"job-1" in server.aof_path.read_bytes()  # written out at shutdown

    # A new server on the same data dir (and another port) replays the AOF.
    with EmbeddedRedis(tmp_path / "redis") as again:
        r = redis.Redis.from_url(again.url)
        assert r.lrange("queue", 0, -1) == [b"job-1", b"job-2"]
        r.close()


def test_stop_is_idempotent(tmp_path):
    server = EmbeddedRedis(tmp_path, appendonly=False).start()
    server.stop()
    server.stop()
    assert not (tmp_path / "appendonly.aof").exists()


def test_a_relative_data_dir_is_where_it_says(tmp_path, monkeypatch):
    """As `llmpipe bench --out bench-results` gives it: redis-server changes to --dir before it
    opens --logfile, so a relative path once pointed under itself and the server exited 1."""
    monkeypatch.chdir(tmp_path)
    with EmbeddedRedis(Path("out/redis"), appendonly=False) as server:
        assert redis_answers(server.url)
    assert (tmp_path / "out" / "redis" / "redis.log").is_file()


def test_ports_and_answers():
    port = free_port()
    assert not port_in_use(port)
    assert not redis_answers(f"redis://127.0.0.1:{port}/0", timeout=0.2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        assert port_in_use(port)


def test_redis_dies_with_its_parent(tmp_path):
    script = tmp_path / "owner.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).resolve().parents[3])!r})
        from llmpipe.local.redis_server import EmbeddedRedis
        server = EmbeddedRedis({str(tmp_path / "data")!r}).start()
        print(server.proc.pid, server.url, flush=True)
        time.sleep(600)
    """))
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pid, url = owner.stdout.readline().split()
        assert alive(int(pid)) and redis_answers(url)
        owner.kill()
        owner.wait(5)
        assert _wait_for(lambda: not alive(int(pid))), "redis-server outlived the process that started it"
    finally:
        owner.kill()
        owner.wait()
