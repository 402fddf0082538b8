"""The pipeline of the fault tests (test_engine_faults.py, test_worker_faults.py): its
fixtures, which each module binds to start a pipeline of its own, and job bodies."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def pipe(rel, tmp_path_factory, tiny_model, broker_url):
    # The limits keep the fuzzed requests cheap for the tiny model on 2 cores: the OpenAPI
    # document states them, so schemathesis generates valid requests up to them (64 prompts x
    # n 8 x 64 tokens would outlast the fuzz's 10 s read timeout). One pipeline per broker:
    # the tests marked each_broker run on RabbitMQ too (tests/conftest.py).
    p = rel.start_pipe(tmp_path_factory.mktemp("faults"), model=tiny_model, faults=rel.FAULTS, max_tokens_limit=16,
                       max_n=2, max_prompts_per_job=4, max_prompt_chars=512, broker_url=broker_url)
    yield p
    rel.stop_pipe(p)


@pytest.fixture(autouse=True)
def _healthy(pipe):
    """Every test starts and ends with all workers up and no injected delay."""
    pipe.clear_delays()
    for kind in ("preprocess", "inference", "postprocess"):
        if not pipe.alive(kind):
            pipe.respawn(kind)
    yield
    pipe.clear_delays()


def body(i: int, text: str = "Tell me a story about", **kw) -> dict:
    return {"prompt": f"{text} {i}", "max_tokens": 8, "temperature": 1.0, "ignore_eos": True, **kw}


def request_ids(job_ids, n_prompts: int = 1) -> list[str]:
    return [f"{j}-{i}" for j in job_ids for i in range(n_prompts)]
