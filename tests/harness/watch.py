"""Observers of a running pipeline: results published per task id, and peak memory."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from typing import TYPE_CHECKING

import psutil
import redis

from tests.harness.waiting import poll

if TYPE_CHECKING:
    from tests.harness.pipe import Pipe


class ResultWatch:
    """Counts the results Celery publishes per task id (the chord callback's id is the job
    id), and how many distinct payloads each had: a job whose result was stored twice, or
    twice differently, is a duplicate."""

    def __init__(self, url: str, subscribed_within_s: float = 10.0):
        self.r = redis.Redis.from_url(url)
        self.count: dict[str, int] = {}
        self.digests: dict[str, set[str]] = {}
        self.first_at: dict[str, float] = {}  # epoch s of a task id's first stored result
        # Pub/sub drops what is published while the connection is down: a test that sees
        # an id counted 0 times tells a lost connection (listed here) from a lost result.
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._ps = self.r.pubsub()
        self._ps.psubscribe("celery-task-meta-*")
        self._await_subscription(subscribed_within_s)
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _await_subscription(self, within_s: float) -> None:
        """Returns once Redis confirmed the pattern: nothing published after that is missed."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            m = self._ps.get_message(timeout=0.5)
            if m and m.get("type") == "psubscribe":
                return
        raise TimeoutError(f"Redis did not confirm the result subscription within {within_s} s")

    def _run(self):
        while not self._stop.is_set():
            try:
                m = self._ps.get_message(timeout=0.5)
            except Exception as e:  # redis-py subscribes again on its next call
                self.errors.append(f"{time.time():.3f} {type(e).__name__}: {e}")
                time.sleep(0.5)
                continue
            if m and m.get("type") == "pmessage":
                self._record(m["channel"].decode().removeprefix("celery-task-meta-"), m["data"])

    def _record(self, tid: str, data: bytes) -> None:
        try:
            payload = json.loads(data)
            body = json.dumps(payload.get("result") if isinstance(payload, dict) else payload, sort_keys=True)
        except ValueError:  # not JSON: its bytes tell two payloads apart
            body = repr(data)
        self.first_at.setdefault(tid, time.time())
        self.count[tid] = self.count.get(tid, 0) + 1
        self.digests.setdefault(tid, set()).add(hashlib.sha1(body.encode()).hexdigest())

    def wait_seen(self, ids, within_s: float = 30.0) -> bool:
        """Waits until each id's result was published, ``within_s`` at most; True when all
        were. A job's record turns terminal in its last task's body, just before Celery
        stores (and publishes) that task's result, so a test that saw every job terminal
        waits here before it counts results."""
        ids = list(ids)
        return bool(poll(lambda: all(j in self.first_at for j in ids), within_s))

    def duplicated(self, ids) -> list[str]:
        return [i for i in ids if self.count.get(i, 0) > 1 and len(self.digests.get(i, ())) > 1]

    def published_twice(self, ids) -> list[str]:
        return [i for i in ids if self.count.get(i, 0) > 1]

    def close(self):
        self._stop.set()
        self._t.join(2)
        try:
            self._ps.close()
        except Exception:
            pass


class MemSampler:
    """Peak RSS of every pipeline process (children included) and of redis-server."""

    def __init__(self, pipe: Pipe, every: float = 0.5):
        self.pipe = pipe
        self.every = every
        self.peak_rss: dict[str, float] = {}
        self.redis_used_peak = 0.0
        self.redis_rss_peak = 0.0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(3)

    def _run(self):
        while not self._stop.is_set():
            try:
                for name, procs in self.pipe.process_tree().items():
                    rss = 0
                    for p in procs:
                        try:
                            rss += p.memory_info().rss
                        except psutil.Error:
                            pass
                    self.peak_rss[name] = max(self.peak_rss.get(name, 0.0), rss / 2**20)
                if self.pipe.redis_server is not None and self.pipe.redis_server.proc is not None:
                    try:
                        rp = psutil.Process(self.pipe.redis_server.proc.pid)
                        self.redis_rss_peak = max(self.redis_rss_peak, rp.memory_info().rss / 2**20)
                    except psutil.Error:
                        pass
                try:
                    used = self.pipe.r.info("memory")["used_memory"] / 2**20
                    self.redis_used_peak = max(self.redis_used_peak, used)
                except Exception:
                    pass
            except Exception:
                pass
            self._stop.wait(self.every)

    @property
    def total_peak_mb(self) -> float:
        return round(sum(self.peak_rss.values()), 1)
