"""One plain ``celery -A tasks worker`` (no -Q: every queue), the development set-up: it
runs on threads with the engine (vLLM, tiny model) in its own process and serves whole
jobs alone. The same worker on an explicit prefork pool refuses before taking a message,
and ``celery -A tasks purge -Q`` empties one queue."""

from __future__ import annotations

import json
import time

import pytest
import redis
from celery.utils.nodenames import gethostname

from llmpipe.stages import worker_queue

pytestmark = pytest.mark.integration

MAX_BATCH = 4
THREADS = 2 * 128  # twice vLLM's running set on a CPU (workers/launch.py)


@pytest.fixture(scope="module")
def dev(tmp_path_factory, redis_server, tiny_model, plain_celery):
    r = redis.Redis.from_url(redis_server.url)
    r.flushdb()
    p = plain_celery(tmp_path_factory.mktemp("dev"), redis_server.url, tiny_model,
                     LLMPIPE_MAX_BATCH_SIZE=str(MAX_BATCH))
    try:
        p.start_api()
        p.wait_http(f"{p.api_url}/version")  # up; /healthz waits for every stage (issue 9)
        waiting = p.submit({"prompt": "Hello", "max_tokens": 4})
        assert r.llen("preprocess") == 1
        p.refused = p.run("worker", "-P", "prefork", "-l", "INFO")
        p.after_refusal = {"preprocess": r.llen("preprocess"), "unacked": r.hlen("unacked"),
                           "job": p.status(waiting)["status"]}
        p.purged = p.run("purge", "-Q", "preprocess", "-f")
        p.after_purge = r.llen("preprocess")
        p.start("dev", "worker", "-l", "INFO")
        p.wait_nodes("celery")
    except BaseException:
        p.stop()
        raise
    yield p
    p.stop()
    r.close()


def test_every_queue_worker_on_prefork_refuses_before_taking_a_message(dev):
    out = dev.refused
    assert out.returncode == 64, out.stderr[-3000:]
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("llmpipe:")]
    assert len(lines) == 1, out.stderr[-3000:]
    assert lines[0].endswith(f"start this worker with: celery -A tasks worker -P threads -c {THREADS} "
                             "--prefetch-multiplier 1")
    assert dev.after_refusal == {"preprocess": 1, "unacked": 0, "job": "queued"}


def test_purge_empties_the_named_queue(dev):
    assert dev.purged.returncode == 0, dev.purged.stderr[-3000:]
    assert "Purged 1 message from 1 known task queue." in dev.purged.stdout
    assert dev.after_purge == 0


def test_the_every_queue_worker_runs_whole_jobs_alone(dev):
    stats = json.loads(dev.run("inspect", "stats", "--json", "--timeout", "3").stdout)
    me = stats[f"celery@{gethostname()}"]
    assert list(stats) == [f"celery@{gethostname()}"]
    assert me["pool"]["implementation"] == "celery.concurrency.thread:TaskPool"
    assert me["pool"]["max-concurrency"] == THREADS
    queues = json.loads(dev.run("inspect", "active_queues", "--json", "--timeout", "3").stdout)
    # Every stage's queue, and the inference worker's own (prefix-aware routing sends there).
    node = f"celery@{gethostname()}"
    assert {q["name"] for q in queues[node]} == {"preprocess", "inference", "postprocess", "collect",
                                                 worker_queue("inference", node)}

    t0 = time.monotonic()
    jobs = [dev.submit({"prompts": ["Once upon a time", "Hello"], "max_tokens": 6, "ignore_eos": True}),
            dev.submit({"messages": [{"role": "user", "content": "Hi <|im_end|>"}], "max_tokens": 6,
                        "ignore_eos": True})]
    views = [dev.wait_job(j) for j in jobs]
    assert [v["status"] for v in views] == ["succeeded", "succeeded"], views
    assert [len(r["token_ids"]) for v in views for r in v["result"]["results"]] == [6, 6, 6]
    print(f"\ntwo jobs on the development worker in {time.monotonic() - t0:.1f}s (busy 2-core machine)")
