"""The broker fixtures of tests/conftest.py: a RabbitMQ that is not there skips a test
locally and fails it under CI=true, never a silent pass."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST = "tests/llmpipe/broker/test_queue_depth.py::test_amqp_depths_count_ready_messages_and_cache_them"


def _run(ci: str) -> subprocess.CompletedProcess:
    from llmpipe.local.redis_server import free_port

    env = {**os.environ, "CI": ci, "LLMPIPE_TEST_AMQP_URL": f"amqp://guest:guest@127.0.0.1:{free_port()}/",
           "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", TEST], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)


def test_unreachable_rabbitmq_fails_in_ci_and_skips_with_the_reason_elsewhere():
    ci = _run("true")
    assert ci.returncode == 1 and "CI=true" in ci.stdout and "unreachable" in ci.stdout, ci.stdout[-2000:]
    local = _run("")
    assert local.returncode == 0 and "1 skipped" in local.stdout and "unreachable" in local.stdout, local.stdout[-2000:]
