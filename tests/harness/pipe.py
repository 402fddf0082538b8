"""A LocalPipeline (real Celery workers, the API, an engine) on its own Redis, and the ways
the tests hurt it: ``Pipe`` (its processes, jobs, fault-injection levers, ledgers and broker
state), ``start_pipe`` and ``stop_pipe``. The reliability tests reach it through their
``rel`` fixture (tests/reliability/conftest.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx
import psutil
import redis
from celery import Celery
from kombu import Connection

from llmpipe.broker.leases import HOLDER_KEY, LEASES_KEY, lease_tags_key
from llmpipe.local.pipeline import LocalPipeline
from llmpipe.local.redis_server import EmbeddedRedis, free_port
from llmpipe.settings import Settings
from llmpipe.stages import STAGE_QUEUES
from llmpipe.testing import faulty
from llmpipe.testing.faulty import DELAYS_KEY, DIED_KEY, DONE_KEY, STARTED_KEY
from tests.harness.engine import TEST_ENGINE
from tests.harness.stacks import teardown
from tests.harness.waiting import poll, wait_until
from workers.launch import KINDS


class Pipe:
    """A running LocalPipeline plus the levers and gauges the tests need."""

    def __init__(self, lp, redis_server: EmbeddedRedis | None):
        self.lp = lp
        self.s = lp.s
        self.redis_server = redis_server
        self.r = redis.Redis.from_url(self.s.redis_url, socket_timeout=5, socket_connect_timeout=2)
        self.http = httpx.Client(base_url=lp.api_url, timeout=15)
        self.probe = Celery(broker=self.s.effective_broker_url)
        self.amqp = None
        if self.s.broker_is_amqp:
            self.amqp = Connection(self.s.effective_broker_url, connect_timeout=3)
        self._released: dict[str, int | None] = {}  # RabbitMQ: queue -> its consumer count before a kill

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
        self.expect_death(kind)
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
        def pinged() -> bool:
            if not self.alive(kind):
                raise AssertionError(f"{kind} exited with {self.child(kind).proc.returncode}; see {self.child(kind).log_path}")
            try:
                return bool(self.probe.control.ping(destination=[self.node(kind)], timeout=0.5))
            except Exception:
                return False

        wait_until(pinged, timeout, f"{kind} to answer its ping", every=0.2)

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

        def settled() -> bool:
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
            pending[:] = still
            return not pending

        if not poll(settled, timeout, every=0.2):
            raise AssertionError(f"{len(pending)} of {len(done) + len(pending)} jobs not terminal after {timeout}s: "
                                 f"{[(j, self.view(j).get('status')) for j in pending[:5]]}")
        return done

    # -- fault injection and ledgers --------------------------------------------------
    def set_delay(self, name: str, seconds: float) -> None:
        self.r.hset(DELAYS_KEY, name, seconds)

    def clear_delays(self) -> None:
        self.r.delete(DELAYS_KEY)

    def clear_delay(self, name: str) -> None:
        self.r.hdel(DELAYS_KEY, name)

    def ledger(self) -> tuple[dict[str, int], dict[str, int]]:
        def load(k):
            return {a.decode(): int(b) for a, b in self.r.hgetall(k).items()}

        return load(STARTED_KEY), load(DONE_KEY)

    def reset_ledger(self) -> None:
        self.r.delete(STARTED_KEY, DONE_KEY, DIED_KEY)

    # -- the broker ------------------------------------------------------------------
    def queue_state(self, queue: str) -> tuple[int, int]:
        """RabbitMQ: (ready messages, consumers) of a queue (passive declare)."""
        ch = self.amqp.channel()
        try:
            ok = ch.queue_declare(queue=queue, passive=True)
            return ok.message_count, ok.consumer_count
        finally:
            ch.close()

    def expect_death(self, kind: str) -> None:
        """RabbitMQ: note the consumers on ``kind``'s queues, so that unacked_before can tell
        when the broker dropped the dead worker's (and requeued what it held). Redis: nothing."""
        if self.amqp is not None:
            self._released = {q: self.queue_state(q)[1] for q in (KINDS[kind].queues if kind in KINDS else ())}

    def lease(self, kind: str) -> str:
        """The lease of a worker's main process (llmpipe/broker/leases.py). RabbitMQ has no leases:
        the worker's consumers stand for it (see expect_death, called by kill)."""
        if self.amqp is not None:
            return f"amqp:{kind}"
        pid = str(self.pid(kind))
        return next(x.decode() for x in self.r.zrange(LEASES_KEY, 0, -1) if x.decode().split(":")[1] == pid)

    def swept(self, lease: str) -> bool:
        """The lease is gone: the messages it held are back in their queues (one script).
        RabbitMQ: the broker dropped the dead worker's consumers, requeueing what they held."""
        if self.amqp is not None:
            return self.unacked_before(float("inf")) == 0
        return self.r.zscore(LEASES_KEY, lease) is None

    def held_count(self, lease: str) -> int:
        """Messages the worker holds now: its lease's tags, or on RabbitMQ the unacked
        messages of the channels consuming its queues. Asked of the channel processes
        (list_channels), which answer live; queue stats (list_queues) lag by up to 5 s."""
        if self.amqp is None:
            return int(self.r.hlen(lease_tags_key(lease)))
        def ctl(*args: str) -> list[list[str]]:
            out = subprocess.run(["rabbitmqctl", "-q", "--no-table-headers", *args],
                                 capture_output=True, text=True, timeout=30).stdout
            return [line.split("\t") for line in out.splitlines() if line.strip()]

        queues = set(KINDS[lease.split(":", 1)[1]].queues)
        vhost = unquote(urlsplit(self.s.effective_broker_url).path[1:]) or "/"
        channels = {row[1].strip() for row in ctl("list_consumers", "-p", vhost, "queue_name", "channel_pid")
                    if len(row) >= 2 and row[0].strip() in queues}
        return sum(int(row[1]) for row in ctl("list_channels", "pid", "messages_unacknowledged")
                   if len(row) >= 2 and row[0].strip() in channels and row[1].strip().isdigit())

    def unacked_before(self, t: float, queue: str | None = None) -> int:
        """Messages delivered before ``t`` and not acked yet (of ``queue`` only, if given).

        RabbitMQ does not say when a message was delivered; it requeues a consumer's
        unacked messages when the consumer's connection drops. There, this is the number of
        the dead worker's queues (see expect_death) whose consumer RabbitMQ still counts."""
        if self.amqp is not None:
            for q, before in list(self._released.items()):
                if before is not None and (queue is None or q == queue) and self.queue_state(q)[1] < before:
                    self._released[q] = None  # dropped: a respawned worker's consumer may come next
            return sum(1 for q, before in self._released.items() if before is not None and (queue is None or q == queue))
        if queue is None:
            return int(self.r.zcount("unacked_index", "-inf", t))
        tags = self.r.zrangebyscore("unacked_index", "-inf", t)
        raw = self.r.hmget("unacked", tags) if tags else []
        return sum(1 for v in raw if v and json.loads(v)[2] == queue)

    def held(self) -> list[tuple]:
        """What is unacked now: (task, age s, holder lease, whether that lease is live), for
        a failure message."""
        out = []
        now = time.time()
        for tag, score in self.r.zrange("unacked_index", 0, -1, withscores=True):
            raw = self.r.hget("unacked", tag)
            task = json.loads(raw)[0].get("headers", {}).get("task") if raw else None
            holder = self.r.hget(HOLDER_KEY, tag)
            live = holder is not None and self.r.zscore(LEASES_KEY, holder) is not None
            kinds = {str(c.proc.pid): c.name for c in self.lp.sup.children if c.proc is not None}
            who = kinds.get(holder.decode().split(":")[1], "?") if holder else None
            out.append((tag.decode(), task, round(now - score, 1), holder and holder.decode(), who, live,
                        raw[:300] if raw else None))
        return out

    def queues_idle(self) -> bool:
        if self.amqp is not None:  # ready messages; the unacked ones settle with their jobs (admission, memo keys)
            return sum(self.queue_state(q)[0] for q in STAGE_QUEUES) == 0
        lens = [self.r.llen(q) for q in STAGE_QUEUES]
        return sum(lens) == 0 and self.r.hlen("unacked") == 0

    def stop(self) -> None:
        self.http.close()
        self.probe.close()
        if self.amqp is not None:
            self.amqp.release()
        teardown(self.lp, timeout=20)


# The reliability stacks: the shipped lease and visibility settings, batches of up to 8, and
# a watchdog that settles a job 1 s after its deadline, checked every 0.5 s.
PIPE_DEFAULTS = dict(cpu_workers=1, max_batch_size=8, batch_window_ms=50, watchdog_interval_s=0.5,
                     watchdog_grace_s=1.0, default_timeout_s=90, **TEST_ENGINE)


def start_pipe(tmp_path: Path, *, engine: str = "transformers", model: str, faults: dict | None = None,
               redis_appendonly: bool = False, ready_timeout: float = 180, **overrides) -> Pipe:
    """A ready LocalPipeline on a Redis of its own (``redis_appendonly``: with AOF), on
    PIPE_DEFAULTS and ``overrides``, with the test-only fault injector set to ``faults``."""
    server = EmbeddedRedis(tmp_path / "redis", appendonly=redis_appendonly).start()
    s = Settings(redis_url=server.url, model=model, engine=engine, state_dir=tmp_path, api_port=free_port(),
                 flower_port=free_port(), **{**PIPE_DEFAULTS, **overrides})
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if faults:
        env.update(faulty.env(faults))
    lp = LocalPipeline(s, flower=False, extra_env=env).start()
    try:
        lp.wait_ready(timeout=ready_timeout)
    except Exception:
        teardown(lp, timeout=10)
        server.stop()
        raise
    return Pipe(lp, server)


def stop_pipe(p: Pipe) -> None:
    try:
        p.stop()
    finally:
        if p.redis_server is not None:
            p.redis_server.stop()
