"""Real pipelines that the reliability tests hurt on purpose (docs/reliability.md).

Each module starts its own Redis and its own LocalPipeline (real Celery workers, the API,
the transformers engine on the tiny model), with a short visibility timeout so that a
crashed worker's messages come back in seconds, and, where asked, the test-only fault
injection of llmpipe/engines/faulty.py. Helpers reach the tests through the ``rel``
fixture (a namespace), since test modules cannot import this conftest.

Every scenario adds a row (jobs sent, completed, lost, duplicated, recovery time, peak
memory) to ``ROWS``; the rows are printed at the end of the session and, when
LLMPIPE_RELIABILITY_OUT names a file, written there as JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import psutil
import pytest
import redis

from llmpipe.redis_server import EmbeddedRedis, free_port

# Markers the fault-injecting engine reacts to (llmpipe/engines/faulty.py).
FAULTS = {
    "poison": "POISONPILL",
    "transient": {"FLAKYOOM": 2, "DOOMEDOOM": 1000},
    "crash": "CRASHME",
    "die": "ENGINEDIE",
    "die_always": "KILLSEVERYWORKER",
    "ledger": True,
}
VISIBILITY_S = 10.0
RESTORE_S = 1.0
MUTEX_S = 2.0  # kombu's restore-sweep lock expiry that celeryconfig derives (visibility / 5)

ROWS: list[dict] = []


def record(row: dict) -> None:
    ROWS.append(row)
    print("\nreliability:", json.dumps(row))
    out = os.environ.get("LLMPIPE_RELIABILITY_OUT")
    if out:
        Path(out).write_text(json.dumps(ROWS, indent=1))


def pytest_terminal_summary(terminalreporter):
    if not ROWS:
        return
    tr = terminalreporter
    tr.section("reliability")
    cols = ["scenario", "sent", "completed", "lost", "duplicated", "recovery_s", "peak_rss_mb", "redis_peak_mb", "wall_s"]
    tr.write_line(" | ".join(cols))
    for row in ROWS:
        tr.write_line(" | ".join(str(row.get(c, "")) for c in cols))


def wait_until(pred, timeout: float, every: float = 0.1, what: str = "condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


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


class Pipe:
    """A running LocalPipeline plus the levers and gauges the tests need."""

    def __init__(self, lp, redis_server: EmbeddedRedis | None):
        from celery import Celery

        self.lp = lp
        self.s = lp.s
        self.redis_server = redis_server
        self.r = redis.Redis.from_url(self.s.redis_url, socket_timeout=5, socket_connect_timeout=2)
        self.http = httpx.Client(base_url=lp.api_url, timeout=15)
        self.probe = Celery(broker=self.s.redis_url)

    # -- processes ------------------------------------------------------------------
    def child(self, kind: str):
        return [c for c in self.lp.sup.children if c.name == kind][-1]

    def pid(self, kind: str) -> int:
        return self.child(kind).proc.pid

    def alive(self, kind: str) -> bool:
        return self.child(kind).proc.poll() is None

    def pool_pids(self, kind: str) -> list[int]:
        try:
            return [p.pid for p in psutil.Process(self.pid(kind)).children()]
        except psutil.Error:
            return []

    def process_tree(self) -> dict[str, list[psutil.Process]]:
        out: dict[str, list[psutil.Process]] = {}
        for c in self.lp.sup.children:
            if c.proc is None or c.proc.poll() is not None:
                continue
            try:
                p = psutil.Process(c.proc.pid)
                out[c.name] = [p, *p.children(recursive=True)]
            except psutil.Error:
                pass
        return out

    def node(self, kind: str) -> str:
        return f"{kind}-{self.s.api_port}@llmpipe"

    def kill(self, kind: str, sig: int = signal.SIGKILL, group: bool = True) -> float:
        pid = self.pid(kind)
        t = time.time()
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
        return t

    def wait_exit(self, kind: str, timeout: float = 60) -> int:
        c = self.child(kind)
        c.proc.wait(timeout)
        return c.proc.returncode

    def respawn(self, kind: str, wait: bool = True, timeout: float = 120) -> float:
        old = self.child(kind)
        self.lp.sup.spawn(kind, old.argv, old.env)
        t0 = time.monotonic()
        if wait:
            self.wait_worker(kind, timeout)
        return time.monotonic() - t0

    def wait_worker(self, kind: str, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if not self.alive(kind):
                raise AssertionError(f"{kind} exited with {self.child(kind).proc.returncode}; see {self.child(kind).log_path}")
            try:
                if self.probe.control.ping(destination=[self.node(kind)], timeout=0.5):
                    return
            except Exception:
                pass
            time.sleep(0.2)
        raise AssertionError(f"{kind} not ready after {timeout}s")

    def log(self, kind: str) -> str:
        return self.child(kind).log_path.read_text(errors="replace")

    # -- jobs -----------------------------------------------------------------------
    def submit(self, body: dict) -> str:
        r = self.http.post("/v1/jobs", json=body)
        assert r.status_code == 202, r.text
        return r.json()["id"]

    def view(self, job_id: str) -> dict:
        return self.http.get(f"/v1/jobs/{job_id}").json()

    def wait_all(self, ids, timeout: float = 120) -> dict[str, dict]:
        """Poll until every job is terminal; each view gets ``_seen_at`` (epoch s)."""
        pending, done = list(ids), {}
        end = time.monotonic() + timeout
        while pending and time.monotonic() < end:
            still = []
            for j in pending:
                try:
                    v = self.view(j)
                except httpx.HTTPError:
                    still.append(j)
                    continue
                if v.get("status") in ("queued", "running", None):
                    still.append(j)
                else:
                    v["_seen_at"] = time.time()
                    done[j] = v
            pending = still
            if pending:
                time.sleep(0.2)
        if pending:
            raise AssertionError(f"{len(pending)} of {len(done) + len(pending)} jobs not terminal after {timeout}s: "
                                 f"{[(j, self.view(j).get('status')) for j in pending[:5]]}")
        return done

    # -- fault injection and ledgers --------------------------------------------------
    def set_delay(self, name: str, seconds: float) -> None:
        from llmpipe.engines.faulty import DELAYS_KEY

        self.r.hset(DELAYS_KEY, name, seconds)

    def clear_delays(self) -> None:
        from llmpipe.engines.faulty import DELAYS_KEY

        self.r.delete(DELAYS_KEY)

    def ledger(self) -> tuple[dict[str, int], dict[str, int]]:
        from llmpipe.engines.faulty import DONE_KEY, STARTED_KEY

        def load(k):
            return {a.decode(): int(b) for a, b in self.r.hgetall(k).items()}

        return load(STARTED_KEY), load(DONE_KEY)

    def reset_ledger(self) -> None:
        from llmpipe.engines.faulty import DIED_KEY, DONE_KEY, STARTED_KEY

        self.r.delete(STARTED_KEY, DONE_KEY, DIED_KEY)

    def unacked_before(self, t: float, queue: str | None = None) -> int:
        """Messages delivered before ``t`` and not acked yet (of ``queue`` only, if given)."""
        if queue is None:
            return int(self.r.zcount("unacked_index", "-inf", t))
        tags = self.r.zrangebyscore("unacked_index", "-inf", t)
        raw = self.r.hmget("unacked", tags) if tags else []
        return sum(1 for v in raw if v and json.loads(v)[2] == queue)

    def queues_idle(self) -> bool:
        lens = [self.r.llen(q) for q in ("preprocess", "inference", "postprocess", "collect")]
        return sum(lens) == 0 and self.r.hlen("unacked") == 0

    def stop(self) -> None:
        self.http.close()
        self.probe.close()
        self.lp.stop(timeout=20)


def start_pipe(tmp_path: Path, *, engine: str = "transformers", model: str, faults: dict | None = None,
               redis_appendonly: bool = False, ready_timeout: float = 180, **overrides) -> Pipe:
    from llmpipe.local import LocalPipeline
    from llmpipe.settings import Settings

    server = EmbeddedRedis(tmp_path / "redis", appendonly=redis_appendonly).start()
    base = dict(
        redis_url=server.url, model=model, engine=engine, state_dir=tmp_path, api_port=free_port(),
        flower_port=free_port(), cpu_workers=1, max_batch_size=8, batch_window_ms=50, kv_cache_gib=1,
        visibility_timeout_s=VISIBILITY_S, unacked_restore_interval_s=RESTORE_S,
        watchdog_interval_s=0.5, watchdog_grace_s=1.0, default_timeout_s=90,
    )
    base.update(overrides)
    s = Settings(**base)
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if faults:
        env["LLMPIPE_FAULT_INJECT"] = json.dumps(faults)
    lp = LocalPipeline(s, flower=False, extra_env=env).start()
    try:
        lp.wait_ready(timeout=ready_timeout)
    except Exception:
        lp.stop(timeout=10)
        server.stop()
        raise
    return Pipe(lp, server)


def stop_pipe(p: Pipe) -> None:
    try:
        p.stop()
    finally:
        if p.redis_server is not None:
            p.redis_server.stop()


def fuzz(schema, *, examples: int, include=lambda op: True, **call_kwargs) -> tuple[list[str], dict]:
    """Property-based requests from the API's own OpenAPI spec (schemathesis), valid and
    invalid ones; returns the failures (a 5xx, or a traceback in a body) and the codes seen."""
    from collections import Counter

    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    failures: list[str] = []
    codes: Counter = Counter()
    for res in schema.get_all_operations():
        op = res.ok()
        if not include(op):
            continue
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck), phases=[Phase.generate])
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                try:
                    resp = case.call(**call_kwargs)
                except Exception as exc:  # the transport failing is a failure too (a crash, a hang)
                    failures.append(f"{op.method.upper()} {op.path} [{mode.value}] raised {type(exc).__name__}: {exc}")
                    return
                codes[f"{op.method.upper()} {op.path} {resp.status_code}"] += 1
                if resp.status_code >= 500 or "Traceback" in resp.text:
                    failures.append(f"{op.method.upper()} {op.path} [{mode.value}] -> {resp.status_code}: "
                                    f"{resp.text[:300]} for {case.as_curl_command()[:500]}")

            try:
                run()
            except Unsatisfiable:  # e.g. no invalid request exists for an operation without inputs
                codes[f"{op.method.upper()} {op.path} [{mode.value}] nothing to generate"] += 1
    return failures, dict(codes)


@pytest.fixture(scope="session")
def rel():
    return SimpleNamespace(
        FAULTS=FAULTS, VISIBILITY_S=VISIBILITY_S, RESTORE_S=RESTORE_S, MUTEX_S=MUTEX_S, record=record,
        wait_until=wait_until,
        start_pipe=start_pipe, stop_pipe=stop_pipe, ResultWatch=ResultWatch, MemSampler=MemSampler, fuzz=fuzz,
    )
