"""What a worker of this app runs with, from the queues and flags it was started with
(workers/pool_policy.py); and that Celery's own command line refuses a pool that cannot
serve the inference queue before it connects to anything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmpipe.settings import Settings
from workers.launch import KINDS
from workers.pool_policy import ALL, EXIT_WRONG_POOL, STAGES, Started, plan, serves

HOST = "gpu-1"
ROOT = Path(__file__).resolve().parents[2]


def _started(queues=("preprocess", "inference", "postprocess", "collect"), pool="prefork", **kw) -> Started:
    base = dict(queues=tuple(queues), pool=pool, pool_given=False, concurrency=2, concurrency_given=False,
                prefetch_given=False, name_given=False)
    return Started(**{**base, **kw})


@pytest.fixture
def s() -> Settings:
    return Settings(max_batch_size=8, cpu_workers=3)


def test_plain_inference_worker_gets_what_llmpipe_worker_inference_runs(s):
    p = plan(_started(["inference"]), s, HOST)
    k = KINDS["inference"]
    assert (p.kind, p.stages, p.refusal) == ("inference", {"inference"}, None)
    assert (p.pool, p.concurrency, p.prefetch, p.node) == (k.pool, k.concurrency(s), k.prefetch, f"inference@{HOST}")
    assert p.concurrency == 256  # twice vLLM's running set on a CPU (128), not 2 x max_batch_size


def test_explicit_prefork_on_the_inference_queue_refuses_with_the_command(s):
    p = plan(_started(["inference"], pool_given=True), s, HOST)
    assert p.refusal is not None and "\n" not in p.refusal
    assert p.refusal.startswith("llmpipe: the inference queue needs -P threads, not -P prefork (vLLM cannot start")
    assert p.refusal.endswith("start this worker with: celery -A tasks worker -Q inference -P threads -c 256 "
                              "--prefetch-multiplier 1 (or: llmpipe worker inference)")


@pytest.mark.parametrize("pool", ["solo", "gevent", "eventlet", "processes"])
def test_every_explicit_pool_but_threads_refuses(s, pool):
    p = plan(_started(["inference"], pool=pool, pool_given=True), s, HOST)
    assert p.refusal is not None and f"not -P {pool} (" in p.refusal


def test_explicit_threads_keeps_the_given_concurrency_and_prefetch(s):
    p = plan(_started(["inference"], pool="threads", pool_given=True, concurrency=5, concurrency_given=True,
                      prefetch_given=True, name_given=True), s, HOST)
    assert (p.pool, p.concurrency, p.prefetch, p.node, p.refusal) == ("threads", None, None, None, None)


def test_a_given_concurrency_is_in_the_refusal(s):
    p = plan(_started(["preprocess", "inference"], pool_given=True, concurrency=3, concurrency_given=True), s, HOST)
    assert p.refusal.endswith("start this worker with: celery -A tasks worker -Q preprocess,inference -P threads -c 3 "
                              "--prefetch-multiplier 1")


def test_no_queue_option_serves_every_stage_on_threads(s):
    p = plan(_started(), s, HOST)
    assert (p.kind, p.stages, p.pool, p.concurrency, p.node) == (ALL, STAGES, "threads", 256, None)
    refused = plan(_started(pool_given=True), s, HOST).refusal
    assert refused.endswith("start this worker with: celery -A tasks worker -P threads -c 256 --prefetch-multiplier 1")


@pytest.mark.parametrize("queues, kind, stages", [
    (["preprocess"], "preprocess", {"preprocess"}),
    (["postprocess", "collect"], "postprocess", {"postprocess", "collect"}),
    (["postprocess"], "postprocess", {"postprocess", "collect"}),
    (["collect"], "collect", {"collect"}),
])
def test_cpu_stages_keep_celerys_pool_and_are_named_by_kind(s, queues, kind, stages):
    p = plan(_started(queues), s, HOST)
    assert (p.kind, p.stages, p.pool, p.concurrency, p.prefetch, p.refusal) == (kind, stages, None, None, None, None)
    assert p.node == f"{kind}@{HOST}"
    assert plan(_started(queues, name_given=True), s, HOST).node is None


def test_a_mix_of_cpu_stages_serves_them_under_celerys_name(s):
    p = plan(_started(["preprocess", "postprocess"]), s, HOST)
    assert (p.kind, p.stages, p.pool, p.node) == (None, {"preprocess", "postprocess"}, None, None)


@pytest.mark.parametrize("kind", list(KINDS))
def test_what_llmpipe_worker_runs_is_left_as_it_is(s, kind):
    k = KINDS[kind]
    p = plan(_started(k.queues, pool=k.pool, pool_given=True, concurrency=k.concurrency(s), concurrency_given=True,
                      prefetch_given=True, name_given=True, kind_env=kind), s, HOST)
    assert (p.kind, p.stages, p.refusal) == (kind, set(k.queues), None)
    assert (p.concurrency, p.prefetch, p.node) == (None, None, None)
    assert p.pool in (None, k.pool)


def test_the_kind_variable_overrides_what_is_warmed(s):
    # LLMPIPE_WORKER_KIND=inference on a worker of the inference queue under another name
    p = plan(_started(["inference"], kind_env="inference"), s, HOST)
    assert (p.kind, p.stages, p.pool) == ("inference", {"inference"}, "threads")
    # and a kind that serves inference puts even a CPU queue's worker on threads
    assert plan(_started(["preprocess"], kind_env="inference"), s, HOST).pool == "threads"


def test_serves_follows_the_kind_variable_outside_a_worker(monkeypatch):
    monkeypatch.setattr("workers.pool_policy._stages", None)
    monkeypatch.setenv("LLMPIPE_WORKER_KIND", "postprocess")
    assert serves("collect") and serves("postprocess", "inference") and not serves("inference")
    monkeypatch.delenv("LLMPIPE_WORKER_KIND")
    assert not serves(*STAGES)
    monkeypatch.setattr("workers.pool_policy._stages", STAGES)
    assert serves("inference")


def _celery_worker(*args: str, **env: str) -> subprocess.CompletedProcess:
    from llmpipe.local.supervisor import python_env

    e = python_env({"LLMPIPE_REDIS_URL": "redis://127.0.0.1:1/0", **env})  # nothing listens there
    e.pop("LLMPIPE_WORKER_KIND", None)
    return subprocess.run([sys.executable, "-m", "celery", "-A", "tasks", "worker", *args], env=e, cwd=ROOT,
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, check=False)


INFERENCE_TAIL = "-Q inference -P threads -c 256 --prefetch-multiplier 1 (or: llmpipe worker inference)"


@pytest.mark.parametrize("args, env, tail", [
    (["-Q", "inference", "-P", "prefork"], {}, INFERENCE_TAIL),
    (["--pool=solo", "-c", "3"], {}, "celery -A tasks worker -P threads -c 3 --prefetch-multiplier 1"),
    (["-Q", "inference"], {"CELERY_WORKER_POOL": "prefork"}, INFERENCE_TAIL),  # Celery's variable for -P
])
def test_celery_command_line_refuses_before_connecting(args, env, tail):
    out = _celery_worker(*args, LLMPIPE_MAX_BATCH_SIZE="32", **env)
    assert out.returncode == EXIT_WRONG_POOL, out.stderr[-2000:]
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("llmpipe:")]
    assert len(lines) == 1 and lines[0].endswith(tail), out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "Connected to" not in out.stderr


def test_readme_quotes_the_refusal_as_it_is(monkeypatch):
    for name in [n for n in os.environ if n.startswith("LLMPIPE_")]:
        monkeypatch.delenv(name)
    refusal = plan(_started(["inference"], pool_given=True), Settings(), HOST).refusal
    assert f"`{refusal}`" in (ROOT / "README.md").read_text()


def test_an_inference_worker_consumes_its_own_queue_first():
    from celery import Celery

    from workers.pool_policy import _consume_own_queue

    app = Celery("t", amqp="llmpipe.broker.worker_queues:AMQP", set_as_current=False)
    app.amqp.queues.select(["inference"])
    own = _consume_own_queue(app, "inference", "inference-1-8000@llmpipe")
    assert own == "inference~inference-1-8000@llmpipe"
    assert list(app.amqp.queues.consume_from) == [own, "inference"]
    assert app.amqp.queues[own].routing_key == own
