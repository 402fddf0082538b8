"""`llmpipe up` startup errors: one line, a non-zero exit, no hang: the API's port in use, a
model path that does not exist, an explicit Redis that does not answer (said before the engine
arguments are checked), and an engine that cannot start (no process left)."""

from __future__ import annotations

import socket
import time

import pytest

from llmpipe.local.redis_server import free_port
from tests.harness.up import error_line, run_up


def test_port_in_use(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.monotonic()
        result = run_up(tmp_path, "--port", str(port), "--redis-url", "embedded")
    assert result.returncode != 0 and time.monotonic() - t0 < 30
    assert f"port {port} for the API is already in use" in error_line(result)


def test_missing_model_path(tmp_path):
    result = run_up(tmp_path, "--port", str(free_port()), "--model", str(tmp_path / "no-such-model"),
                     "--redis-url", "embedded")
    assert result.returncode != 0
    assert "does not exist" in error_line(result)


def test_explicit_redis_that_does_not_answer(tmp_path):
    result = run_up(tmp_path, "--port", str(free_port()), "--redis-url", f"redis://127.0.0.1:{free_port()}/0")
    assert result.returncode != 0
    assert "does not answer" in error_line(result)


def test_a_dead_redis_is_said_before_the_engine_arguments_are_checked(tmp_path):
    # The engine-argument check imports vLLM (seconds); the Redis check answers at once.
    result = run_up(tmp_path, "--port", str(free_port()), "--redis-url", f"redis://127.0.0.1:{free_port()}/0",
                    "--engine-arg", "tensor_paralel_size=2")
    assert result.returncode != 0
    assert "does not answer" in error_line(result)


@pytest.mark.integration
def test_engine_that_cannot_start(tmp_path, ups, tiny_model):
    up = ups(tmp_path / "state", "--model", tiny_model, "--engine", "transformers", "--redis-url", "embedded",
             "--cpu-workers", "1", "--no-flower", "--quiet", LLMPIPE_DTYPE="no-such-dtype")
    assert up.wait(120) == 1, up.err
    line = [ln for ln in up.err.splitlines() if ln.startswith("llmpipe up: ")]
    assert len(line) == 1 and "inference exited with code 3: engine transformers could not start" in line[0], up.err
    assert "no-such-dtype" in line[0] and "Traceback" not in up.err
    assert up.left_alive() == []
