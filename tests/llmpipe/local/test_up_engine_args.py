"""`llmpipe up --engine-arg KEY=VALUE`: a misspelt argument stops `up` before anything
starts. That a good one reaches vLLM, on a real `up` of the tiny model: test_up.py
(`test_up_restarts_what_is_killed` runs with `--engine-arg max_model_len=128`)."""

from __future__ import annotations

from llmpipe.local.redis_server import free_port
from tests.harness.up import error_line, run_up


def test_misspelt_engine_arg_stops_up_before_anything_starts(tmp_path):
    result = run_up(tmp_path, "--port", str(free_port()), "--redis-url", "embedded",
                    "--engine-arg", "tensor_paralel_size=2", timeout=120)
    assert result.returncode == 1
    assert error_line(result) == ("llmpipe up: unknown vLLM engine argument 'tensor_paralel_size' (did you mean "
                                  "tensor_parallel_size?): not a field of vLLM's AsyncEngineArgs")
    assert not (tmp_path / "state" / "logs").exists()  # no child was started
