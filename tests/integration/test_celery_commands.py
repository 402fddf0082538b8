"""Every stage started with Celery's own command, as a Celery user would (README.md,
"Celery's own commands"), vLLM on the tiny model; Celery's tools (inspect, status, Flower)
against it; and an inference worker started on the pool that cannot serve it."""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest
import redis
from celery.utils.nodenames import gethostname

from llmpipe.testing import faulty
from tests.harness.waiting import wait_until

pytestmark = pytest.mark.integration

MAX_BATCH = 8
THREADS = 2 * 128  # what `llmpipe worker inference` runs on vLLM: twice its running set on a CPU (workers/launch.py)
FLOWER_AUTH = ("admin", "s3cret")


@pytest.fixture(scope="module")
def plain(tmp_path_factory, redis_server, tiny_model, plain_celery):
    r = redis.Redis.from_url(redis_server.url)
    r.flushdb()
    p = plain_celery(tmp_path_factory.mktemp("plain"), redis_server.url, tiny_model,
                     LLMPIPE_MAX_BATCH_SIZE=str(MAX_BATCH))
    try:
        p.start_api()
        # The CPU stages' -c only bounds the processes on a many-core machine: the pool
        # stays Celery's default (prefork).
        p.start("preprocess", "worker", "-Q", "preprocess", "-c", "2", "-l", "INFO")
        p.start("postprocess", "worker", "-Q", "postprocess,collect", "-c", "2", "-l", "INFO")
        p.start("flower", "flower", f"--port={p.flower_port}", "--address=127.0.0.1",
                env={"FLOWER_BASIC_AUTH": ":".join(FLOWER_AUTH)})
        p.wait_nodes("preprocess", "postprocess")
        p.wait_http(f"{p.api_url}/version")  # up; /healthz waits for every stage (issue 9)
        p.wait_http(f"http://127.0.0.1:{p.flower_port}/api/workers", auth=FLOWER_AUTH)

        # A job waits in the inference queue; then an inference worker is started on the
        # pool that cannot run it.
        p.first_job = p.submit({"prompt": "The capital of France is", "max_tokens": 8, "ignore_eos": True})
        end = time.monotonic() + 120
        while r.llen("inference") < 1:
            assert time.monotonic() < end, "the job never reached the inference queue"
            time.sleep(0.1)
        t0 = time.monotonic()
        p.refused = p.run("worker", "-Q", "inference", "-P", "prefork", "-l", "INFO")
        p.refused_s = time.monotonic() - t0
        p.after_refusal = {"inference": r.llen("inference"), "unacked": r.hlen("unacked"),
                           "job": p.status(p.first_job)["status"]}

        p.start("inference", "worker", "-Q", "inference", "-l", "INFO")
        p.wait_nodes("preprocess", "inference", "postprocess")
    except BaseException:
        p.stop()
        raise
    yield p
    p.stop()
    r.close()


def test_inference_worker_on_prefork_refuses_before_taking_a_message(plain):
    out = plain.refused
    assert out.returncode == 64, out.stderr[-3000:]
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("llmpipe:")]
    assert len(lines) == 1, out.stderr[-3000:]
    assert lines[0].endswith(f"start this worker with: celery -A tasks worker -Q inference -P threads -c {THREADS} "
                             "--prefetch-multiplier 1 (or: llmpipe worker inference)")
    assert "Traceback" not in out.stderr and "ready." not in out.stderr
    # It took nothing: the job's message is still in the queue, none is held unacked, the
    # job did not fail; a worker started right then serves it.
    assert plain.after_refusal == {"inference": 1, "unacked": 0, "job": "running"}
    view = plain.wait_job(plain.first_job)
    assert view["status"] == "succeeded", view
    assert len(view["result"]["results"][0]["token_ids"]) == 8
    print(f"\nrefusing worker exited in {plain.refused_s:.1f}s (busy 2-core machine)")


def _log(child) -> str:
    return child.log_path.read_text() if child.log_path.exists() else ""  # made by its first line


def test_a_warm_shutdown_while_the_engine_loads_stops_without_waiting_for_it(plain):
    """A second inference worker, told to stop (SIGTERM) while its engine loads, stops at
    once with code 0: the load is held for an hour (llmpipe/testing/faulty.py's ``load``
    hold, which swallows what is raised into it, as a real load may), and the worker never
    says its engine is ready."""
    r = redis.Redis.from_url(plain.redis_url)
    r.hset(faulty.DELAYS_KEY, "load", 3600)
    try:
        w = plain.start("loading", "worker", "-Q", "inference", "-n", "loading@%h", "-l", "INFO",
                        env=faulty.env({}))
        wait_until(lambda: "holding the load" in _log(w) or not w.running, 240,
                   "the second inference worker's engine load to reach its hold")
        assert w.running, _log(w)[-3000:]
        w.proc.send_signal(signal.SIGTERM)
        code = w.proc.wait(timeout=120)
        wait_until(lambda: w.proc.stdout.closed, 30, "its log copied whole")  # the supervisor's copy ended
    finally:
        r.hdel(faulty.DELAYS_KEY, "load")
        r.close()
    log = _log(w)
    assert code == 0, log[-3000:]
    assert "SIGTERM while the engine loads: stopping now, with no request held" in log, log[-3000:]
    # The load got as far as its hold (the engine built: "vLLM engine ready in ..."); the
    # worker itself never said its engine was ready, nor Celery that the worker was.
    assert "MainProcess] engine ready" not in log and "ready." not in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


def test_a_job_runs_to_success_on_plain_celery_workers(plain):
    job = plain.submit({"prompts": ["Once upon a time", "Hello"], "max_tokens": 6, "ignore_eos": True})
    view = plain.wait_job(job)
    assert view["status"] == "succeeded", view
    assert [len(r["token_ids"]) for r in view["result"]["results"]] == [6, 6]
    assert all(set(r["timings"]) == {"preprocess", "inference", "postprocess"} for r in view["result"]["results"])


def _json(out) -> dict:
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_inspect_stats_shows_the_pool_each_queue_got(plain):
    stats = _json(plain.run("inspect", "stats", "--json", "--timeout", "3"))
    host = gethostname()
    assert set(stats) == {f"{k}@{host}" for k in ("preprocess", "inference", "postprocess")}
    inference = stats[f"inference@{host}"]
    assert inference["pool"]["implementation"] == "celery.concurrency.thread:TaskPool"
    assert inference["pool"]["max-concurrency"] == THREADS
    assert inference["prefetch_count"] == THREADS  # prefetch multiplier 1
    for cpu in ("preprocess", "postprocess"):  # Celery's defaults: prefork, prefetch 1 from celeryconfig
        pool = stats[f"{cpu}@{host}"]["pool"]
        assert pool["implementation"] == "celery.concurrency.prefork:TaskPool"
        assert stats[f"{cpu}@{host}"]["prefetch_count"] == pool["max-concurrency"]


def test_inspect_active_and_status_list_every_worker(plain):
    host = gethostname()
    nodes = {f"{k}@{host}" for k in ("preprocess", "inference", "postprocess")}
    active = _json(plain.run("inspect", "active", "--json", "--timeout", "3"))
    assert set(active) == nodes and all(isinstance(v, list) for v in active.values())
    status = plain.run("status", "--timeout", "3")
    assert status.returncode == 0, status.stderr
    assert all(f"{n}: OK" in status.stdout for n in nodes)
    assert "3 nodes online." in status.stdout


def test_flower_with_basic_auth_from_its_variable(plain):
    url = f"http://127.0.0.1:{plain.flower_port}"
    assert httpx.get(f"{url}/api/workers", timeout=10).status_code == 401
    assert httpx.get(f"{url}/api/workers", auth=("admin", "wrong"), timeout=10).status_code == 401
    workers = httpx.get(f"{url}/api/workers", params={"refresh": "1"}, auth=FLOWER_AUTH, timeout=30).json()
    assert {w.split("@")[0] for w in workers} == {"preprocess", "inference", "postprocess"}
    # Several prompts: a chord, so the collect task runs too (a one-prompt job has no collect hop).
    assert plain.wait_job(plain.submit({"prompts": ["Hello", "Hi"], "max_tokens": 4}))["status"] == "succeeded"
    want = {"llmpipe.preprocess", "llmpipe.inference", "llmpipe.postprocess", "llmpipe.collect"}
    end = time.monotonic() + 30
    while True:
        tasks = httpx.get(f"{url}/api/tasks", auth=FLOWER_AUTH, timeout=30).json().values()
        done = {t["name"] for t in tasks if t["state"] == "SUCCESS"}
        if want <= done:
            break
        assert time.monotonic() < end, f"Flower does not list every stage's tasks: {tasks}"
        time.sleep(0.5)
