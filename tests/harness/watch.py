"""Observers of a running pipeline: results published per task id, and peak memory."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from typing import TYPE_CHECKING

import psutil
import redis

if TYPE_CHECKING:
    from tests.harness.pipe import Pipe


class ResultWatch:
    """Counts the results Celery publishes per task id (the chord callback's id is the job
    id), and how many distinct payloads each had: a job whose result was stored twice, or
    twice differently, is a duplicate."""

    def __init__(self, url: str):
        self.r = redis.Redis.from_url(url)
        self.count: dict[str, int] = {}
        self.digests: dict[str, set[str]] = {}
        self.first_at: dict[str, float] = {}  # epoch s of a task id's first stored result
        self._stop = threading.Event()
        self._ps = self.r.pubsub(ignore_subscribe_messages=True)
        self._ps.psubscribe("celery-task-meta-*")
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                m = self._ps.get_message(timeout=0.5)
            except Exception:
                time.sleep(0.5)
                continue
            if not m or m.get("type") != "pmessage":
                continue
            tid = m["channel"].decode().removeprefix("celery-task-meta-")
            try:
                payload = json.loads(m["data"])
                body = json.dumps(payload.get("result"), sort_keys=True)
            except ValueError:
                body = repr(m["data"])
            self.first_at.setdefault(tid, time.time())
            self.count[tid] = self.count.get(tid, 0) + 1
            self.digests.setdefault(tid, set()).add(hashlib.sha1(body.encode()).hexdigest())

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
