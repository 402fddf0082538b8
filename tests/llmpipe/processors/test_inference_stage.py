"""The inference task's body (llmpipe/processors/inference_stage.py) without Celery: real
Redis (memo, dead letters), an InferenceProcessor over a fake engine."""

from __future__ import annotations

import time

import pytest

from llmpipe.engines.base import Engine, EngineOutput
from llmpipe.errors import EngineError
from llmpipe.jobs.deadletter import DeadLetters
from llmpipe.jobs.memo import StageMemo
from llmpipe.messages import FinishReason, SamplingParams, TokenizedRequest
from llmpipe.processors.inference_processor import InferenceProcessor
from llmpipe.processors.inference_stage import InferenceStage


class ReversingEngine(Engine):
    """Emits the prompt reversed; a prompt of [0] fails every time."""

    name = "reversing"

    def __init__(self):
        self.runs = 0

    def generate(self, batch, on_tokens=None):
        self.runs += 1
        if any(r.prompt_token_ids == [0] for r in batch):
            raise EngineError("poison")
        return [EngineOutput(r.request_id, list(reversed(r.prompt_token_ids)), FinishReason.LENGTH) for r in batch]

    def abort(self, request_ids):
        pass

    def shutdown(self):
        pass


@pytest.fixture
def parts(redis_client):
    engine = ReversingEngine()
    proc = InferenceProcessor(engine, window_s=0.0, max_size=4)
    memo = StageMemo(redis_client, slack_s=60, max_deliveries=2)
    dl = DeadLetters(redis_client)
    built = []

    def processor() -> InferenceProcessor:
        built.append(1)
        return proc

    yield InferenceStage(memo, processor, dl, model="tiny", max_deliveries=2), engine, memo, dl, built
    proc.shutdown()


def _msg(job_id: str, ids: list[int]) -> dict:
    now = time.time()
    return TokenizedRequest(job_id=job_id, index=0, deadline=now + 60, enqueued_at=now, prompt_token_ids=ids,
                            params=SamplingParams(max_tokens=8)).model_dump(mode="json")


def test_a_request_runs_once_and_its_redelivery_replays_the_result(parts):
    stage, engine, _, _, built = parts
    msg = _msg("i1", [1, 2, 3])
    first = stage.run(msg)
    assert first["output_token_ids"] == [3, 2, 1] and "error" not in first
    assert stage.run(msg) == first and engine.runs == 1
    assert built  # the processor is asked for when a request runs, not before


def test_an_engine_error_for_good_is_dead_lettered(parts):
    stage, _, _, dl, _ = parts
    out = stage.run(_msg("i2", [0]))
    assert out["error"]["reason"] == "engine_error"
    [entry] = dl.list()
    assert (entry["stage"], entry["reason"], entry["request_id"], entry["prompt_tokens"]) == (
        "inference", "engine_error", "i2-0", 1)


def test_a_request_that_keeps_losing_its_worker_is_not_run_again(parts):
    stage, engine, memo, dl, _ = parts
    msg = _msg("i3", [1, 2])
    for _ in range(2):  # two deliveries whose worker died before it stored a result
        memo.begin("inference", "i3-0", time.time() + 60)
    out = stage.run(msg)
    assert engine.runs == 0
    assert out["error"]["reason"] == "engine_error" and "delivered 3 times" in out["error"]["message"]
    assert out["timings"] == msg["timings"]
    [entry] = dl.list()
    assert (entry["reason"], entry["deliveries"]) == ("max_deliveries", 3)


def test_a_request_that_failed_before_passes_through_without_the_memo(parts, redis_client):
    stage, engine, _, dl, _ = parts
    msg = _msg("i4", [1])
    msg["error"] = {"reason": "invalid_request", "message": "bad", "stage": "preprocess"}
    out = stage.run(msg)
    assert out["error"]["reason"] == "invalid_request" and engine.runs == 0
    assert not redis_client.keys("llmpipe:idem:*") and dl.count() == 0
