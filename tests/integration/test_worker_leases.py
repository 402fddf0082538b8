"""Workers started alone, with Celery's own command and no supervisor anywhere (no
``llmpipe up``), on the shipped lease settings: one is killed with kill -9 while it holds
messages and a worker that the test starts replaces it; another runs a task much longer
than the lease TTL. The app (tests/integration/lease_app.py) loads llmpipe's celeryconfig,
so the lease transport, and needs no model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import redis
from celery import Celery

from llmpipe.broker.leases import LEASES_KEY, lease_tags_key
from llmpipe.settings import Settings
from tests.harness.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TTL_S = Settings.model_fields["lease_ttl_s"].default
SWEEP_S = Settings.model_fields["lease_sweep_interval_s"].default
SLACK_S = 2.0  # polling every 0.05 s and thread scheduling on 2 busy cores
STARTED, DONE, RESULTS = "leasetest:started", "leasetest:done", "leasetest:results"


class Workers:
    def __init__(self, url: str, tmp: Path, broker_url: str | None = None):
        self.url, self.tmp, self.broker_url = url, tmp, broker_url
        self.procs: dict[str, subprocess.Popen] = {}
        self.r = redis.Redis.from_url(url)

    def start(self, name: str, queue: str, *, concurrency: int = 2, pool: str = "prefork") -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMPIPE_")}  # shipped defaults
        env.update(LLMPIPE_REDIS_URL=self.url, PYTHONPATH=str(ROOT))
        if self.broker_url:
            env["LLMPIPE_BROKER_URL"] = self.broker_url
        argv = [sys.executable, "-m", "celery", "-A", "tests.integration.lease_app", "worker", "-Q", queue,
                "-P", pool, "-c", str(concurrency), "--prefetch-multiplier", "1", "-n", f"{name}@%h", "-l", "INFO",
                "--without-gossip", "--without-mingle", "--without-heartbeat"]
        log = open(self.tmp / f"{name}.log", "w")
        p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = p
        return p

    def lease(self, name: str, timeout: float = 60) -> str:
        """The lease of a worker's main process (taken when it starts consuming)."""
        pid = self.procs[name].pid

        def find():
            if self.procs[name].poll() is not None:
                raise AssertionError(f"{name} exited: {(self.tmp / f'{name}.log').read_text()[-2000:]}")
            return next((x.decode() for x in self.r.zrange(LEASES_KEY, 0, -1) if x.decode().split(":")[1] == str(pid)),
                        None)

        return wait_until(find, timeout, f"{name}'s lease")

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(10)


def counts(r, key: str) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in r.hgetall(key).items()}


@pytest.fixture
def workers(redis_url, redis_client, tmp_path):
    w = Workers(redis_url, tmp_path)
    yield w
    w.stop()


@pytest.fixture
def sender(redis_url):
    app = Celery("leasetest-client", broker=redis_url, backend=redis_url)
    app.conf.update(broker_transport="llmpipe.broker.redis_transport:Transport", task_serializer="json",
                    accept_content=["json"], task_routes={"leasetest.hold": {"queue": "leasetest"}})
    yield app
    app.close()


def test_a_killed_standalone_workers_messages_come_back_in_seconds_and_a_long_task_runs_once(workers, sender,
                                                                                             redis_client):
    r = redis_client
    # A worker of another stage, alive throughout: like the rest of a pipeline, it sweeps.
    # Meanwhile it runs a task 3x longer than the lease TTL, which must run once.
    workers.start("bystander", "other", concurrency=1, pool="solo")
    workers.start("doomed", "leasetest")
    workers.lease("bystander")
    doomed_lease = workers.lease("doomed")
    long_task = sender.send_task("leasetest.hold", ("long", 3 * TTL_S), queue="other")

    ids = {f"job{i}": sender.send_task("leasetest.hold", (f"job{i}", 3.0)) for i in range(6)}
    wait_until(lambda: len(counts(r, STARTED)) >= 3, 60, "the doomed worker running two jobs")  # 2 + long
    held = r.hlen(lease_tags_key(doomed_lease))
    assert held == 2, held  # prefork -c 2, prefetch 1 per process
    children = [p.pid for p in psutil.Process(workers.procs["doomed"].pid).children()]

    t_kill = time.monotonic()
    os.kill(workers.procs["doomed"].pid, signal.SIGKILL)  # the main process alone: its pool children are orphaned
    workers.procs["doomed"].wait(10)
    workers.start("replacement", "leasetest")  # what an operator or a supervisor does
    wait_until(lambda: r.zscore(LEASES_KEY, doomed_lease) is None and r.hlen(lease_tags_key(doomed_lease)) == 0,
             TTL_S + SWEEP_S + 30, "the dead lease swept")
    back_s = time.monotonic() - t_kill
    wait_until(lambda: len(counts(r, DONE)) >= len(ids) + 1 and r.hlen("unacked") == 0, 90, "every job done")
    done_s = time.monotonic() - t_kill
    results = {k: v.get(timeout=10) for k, v in ids.items()}
    orphans_alive = [pid for pid in children if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    for pid in orphans_alive:
        os.kill(pid, signal.SIGKILL)

    started, done = counts(r, STARTED), counts(r, DONE)
    print(f"\nkill -9 of a standalone worker's main process holding {held} messages: back in the queue "
          f"{back_s:.2f} s after the kill (lease_ttl_s {TTL_S} + sweep {SWEEP_S}), every job done {done_s:.2f} s "
          f"after (including the replacement's start); runs per job {started}, finished runs {done}; orphaned pool children still "
          f"alive at the end: {len(orphans_alive)}")
    assert back_s <= TTL_S + SWEEP_S + SLACK_S
    # every job has one result: the first one stored, the one its task returned
    stored = {k.decode(): v.decode() for k, v in r.hgetall(RESULTS).items()}
    assert set(stored) == set(ids) | {"long"}
    assert results == {k: stored[k] for k in ids}
    assert all(done[k] >= 1 for k in ids)
    # the two held jobs ran again elsewhere (their first runs were in the orphaned children)
    assert sum(1 for k in ids if started[k] >= 2) == held
    # the long task's worker was alive throughout: its message was never redelivered
    assert long_task.get(timeout=30) == stored["long"]
    assert started["long"] == 1 and done["long"] == 1


def test_a_killed_standalone_worker_on_rabbitmq_is_replaced_and_every_job_has_one_result(rabbitmq_url, redis_url,
                                                                                       redis_client, tmp_path):
    """The same kill on RabbitMQ (quorum queues, no leases): the broker requeues what the
    dead worker's connection held as the connection drops, and the replacement runs it."""
    from kombu import Connection

    r = redis_client
    with Connection(rabbitmq_url, connect_timeout=3) as c:  # a queue of an earlier run, if any
        ch = c.channel()
        try:
            ch.queue_delete("leasetest")
        except Exception:
            pass

    def queue_state() -> tuple[int, int] | None:
        with Connection(rabbitmq_url, connect_timeout=3) as c:
            ch = c.channel()
            try:
                ok = ch.queue_declare(queue="leasetest", passive=True)
                return ok.message_count, ok.consumer_count
            except Exception:  # not declared yet
                return None

    workers = Workers(redis_url, tmp_path, broker_url=rabbitmq_url)
    sender = Celery("leasetest-client", broker=rabbitmq_url, backend=redis_url)
    # as the workers declare it (celeryconfig: quorum queues)
    sender.conf.update(task_serializer="json", accept_content=["json"], task_default_queue_type="quorum",
                       task_routes={"leasetest.hold": {"queue": "leasetest"}})
    try:
        doomed = workers.start("doomed", "leasetest")
        wait_until(lambda: (queue_state() or (0, 0))[1] >= 1 or doomed.poll() is not None, 90, "the doomed worker consuming")
        assert doomed.poll() is None, workers.log("doomed")[-2000:]
        ids = {f"job{i}": sender.send_task("leasetest.hold", (f"job{i}", 3.0)) for i in range(6)}
        wait_until(lambda: len(counts(r, STARTED)) >= 2, 60, "the doomed worker running two jobs")
        held = len(counts(r, STARTED))
        assert held == 2, held  # prefork -c 2, prefetch 1 per process

        t_kill = time.monotonic()
        os.kill(doomed.pid, signal.SIGKILL)  # the main process alone
        doomed.wait(10)
        wait_until(lambda: queue_state()[1] == 0, 30, "RabbitMQ to drop the dead worker's consumer")
        back_s = time.monotonic() - t_kill
        workers.start("replacement", "leasetest")  # what an operator or a supervisor does
        wait_until(lambda: len(counts(r, DONE)) >= len(ids), 120, "every job done")
        done_s = time.monotonic() - t_kill
        results = {k: v.get(timeout=30) for k, v in ids.items()}
    finally:
        sender.close()
        workers.stop()
    started, done = counts(r, STARTED), counts(r, DONE)
    print(f"\nRabbitMQ, kill -9 of a standalone worker's main process holding {held} messages: consumer dropped "
          f"{back_s:.2f} s after the kill, every job done {done_s:.2f} s after (including the replacement's start); "
          f"runs per job {started}, finished runs {done}")
    assert back_s <= TTL_S + SWEEP_S + SLACK_S
    stored = {k.decode(): v.decode() for k, v in r.hgetall(RESULTS).items()}
    assert set(stored) == set(ids)
    assert results == stored  # one result per job: the first stored, the one its task returned
    assert sum(1 for k in ids if started[k] >= 2) == held  # the held ones ran again in the replacement
