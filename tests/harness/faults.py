"""The test-only fault injector's markers (llmpipe/testing/faulty.py), the shipped recovery
bounds, and the pipeline of the fault tests (test_engine_faults.py, test_worker_faults.py):
its fixtures, which each module binds, and job bodies."""

from __future__ import annotations

import pytest

from llmpipe.settings import Settings

# What the reliability stacks' engine reacts to: a prompt holding a marker fails, fails for
# a while, crashes the task, kills the engine or kills every worker; the ledger counts runs.
FAULTS = {
    "poison": "POISONPILL",
    "transient": {"FLAKYOOM": 2, "DOOMEDOOM": 1000},
    "crash": "CRASHME",
    "die": "ENGINEDIE",
    "die_always": "KILLSEVERYWORKER",
    "ledger": True,
}
# What tests/integration/test_api_guarantees.py's engine reacts to: a poison pill, and a
# request that fails its batch after 8 tokens.
API_FAULTS = {"poison": "POISONPILL", "fail_after_tokens": {"LATEPOISON": 8}, "ledger": True}

# The shipped defaults (never overridden here): a dead worker's messages are back in the
# queue within RECOVERY_S of its death (llmpipe/broker/leases.py).
LEASE_TTL_S = Settings.model_fields["lease_ttl_s"].default
LEASE_SWEEP_S = Settings.model_fields["lease_sweep_interval_s"].default
RECOVERY_S = LEASE_TTL_S + LEASE_SWEEP_S
# What a bound measured from this process may add: polling every 0.1 s and the sweeping
# thread's scheduling on 2 busy cores.
SLACK_S = 2.0
# the reliability tests poll every 0.1 s (their bounds allow for it: SLACK_S)
POLL_S = 0.1


@pytest.fixture(scope="module")
def pipe(rel, tmp_path_factory, tiny_model, broker_url):
    # The limits keep the fuzzed requests cheap for the tiny model on 2 cores: the OpenAPI
    # document states them, so schemathesis generates valid requests up to them (64 prompts x
    # n 8 x 64 tokens would outlast the fuzz's 10 s read timeout). One pipeline per broker:
    # the tests marked each_broker run on RabbitMQ too (tests/harness/brokers.py).
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
