"""The CPU stages' task bodies (llmpipe/processors/cpu_stages.py) without Celery: real
Redis (job store, memo) and the tiny model's tokenizer."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from llmpipe.errors import ModelNotFoundError
from llmpipe.jobs.memo import StageMemo
from llmpipe.jobs.store import JobStore
from llmpipe.messages import FinishReason, Generation, JobStatus, StageTiming
from llmpipe.processors.collector import JobFinisher
from llmpipe.processors.cpu_stages import PostprocessStage, PreprocessStage, TokenizeStage
from llmpipe.processors.input_processor import InputProcessor
from llmpipe.processors.output_processor import OutputProcessor
from llmpipe.processors.tokenizer import TokenizerOwner


@pytest.fixture(scope="module")
def resources(tiny_model):
    owner = TokenizerOwner(tiny_model)
    tok = owner.get()
    yield SimpleNamespace(input_processor=InputProcessor(tok, 2048), output_processor=OutputProcessor(tok))
    owner.shutdown()


@pytest.fixture
def models(resources):
    def get(name: str | None):
        if name not in (None, "tiny"):
            raise ModelNotFoundError(f"The model `{name}` does not exist", param="model")
        return resources

    return get


def _prompt(job_id: str, now: float, **kw) -> dict:
    return {"job_id": job_id, "index": 0, "deadline": now + 60, "enqueued_at": now, "prompt": "Hello there",
            "params": {"max_tokens": 4}, **kw}


def _generation(job_id: str, now: float) -> dict:
    t = StageTiming(stage="inference", enqueued_at=now - 0.02, started_at=now - 0.01, finished_at=now)
    return Generation(job_id=job_id, index=0, deadline=now + 60, enqueued_at=now, prompt_tokens=3,
                      output_token_ids=[5, 6, 7, 8], finish_reason=FinishReason.LENGTH, batch_size=1,
                      engine_time_s=0.01, first_token_at=now - 0.005, timings=[t]).model_dump(mode="json")


def test_preprocess_tokenizes_starts_the_job_and_names_an_unknown_model(redis_client, models):
    jobs = JobStore(redis_client, 60)
    stage = PreprocessStage(jobs, models, "tiny")
    now = time.time()
    jobs.create("p1", n_prompts=1, deadline=now + 60, now=now)
    out = stage.run(_prompt("p1", now))
    assert out["prompt_token_ids"] and "error" not in out
    assert [t["stage"] for t in out["timings"]] == ["preprocess"]
    assert jobs.get("p1").status == JobStatus.RUNNING

    jobs.create("p2", n_prompts=1, deadline=now + 60, now=now)
    out = stage.run(_prompt("p2", now, model="other"))
    assert out["error"]["reason"] == "model_not_found" and out["error"]["stage"] == "preprocess"
    assert out["prompt_token_ids"] == []


def test_preprocess_sends_the_inference_hop_where_routing_says_and_a_failed_request_nowhere(redis_client, models):
    jobs = JobStore(redis_client, 60)
    asked, sent = [], []

    def route(req):
        asked.append(req.prompt_token_ids)
        return "inference~w1@h" if len(asked) == 1 else None

    stage = PreprocessStage(jobs, models, "tiny", route=route)
    now = time.time()
    for j in ("r1", "r2", "r3"):
        jobs.create(j, n_prompts=1, deadline=now + 60, now=now)
    out = stage.run(_prompt("r1", now), send_next_to=sent.append)
    assert sent == ["inference~w1@h"] and asked == [out["prompt_token_ids"]]
    stage.run(_prompt("r2", now), send_next_to=sent.append)  # routing says: the shared queue
    assert sent == ["inference~w1@h"] and len(asked) == 2
    stage.run(_prompt("r3", now, model="other"), send_next_to=sent.append)  # failed: passed on as it is
    assert len(asked) == 2
    stage.run(_prompt("r1", now))  # no chain to redirect (a direct call): routing is not asked
    assert len(asked) == 2


def test_preprocess_of_a_job_that_ended_passes_its_end_on(redis_client, models):
    jobs = JobStore(redis_client, 60)
    stage = PreprocessStage(jobs, models, "tiny")
    now = time.time()
    for job_id, status in (("e1", JobStatus.EXPIRED), ("c1", JobStatus.CANCELLED)):
        jobs.create(job_id, n_prompts=1, deadline=now + 60, now=now)
        jobs.stop(job_id, status, {"type": status.value, "message": "x"})
        out = stage.run(_prompt(job_id, now))
        assert out["error"]["reason"] == status.value
        assert out["error"]["message"] == f"job {status.value} before preprocess"


def test_postprocess_keeps_the_first_token_time_and_replays_a_redelivery_from_the_memo(redis_client, models):
    stage = PostprocessStage(StageMemo(redis_client, slack_s=60), models, "tiny",
                             JobFinisher(JobStore(redis_client, 60), release=lambda j: None, forget=lambda ids: None,
                                         default_model="tiny"))
    msg = _generation("m1", time.time())
    first = stage.run(msg)
    assert first["token_ids"] == [5, 6, 7, 8] and first["completion_tokens"] == 4
    assert first["first_token_at"] == msg["first_token_at"]  # the engine's, for a client's TTFT breakdown
    assert stage.run(msg) == first  # delivered again: the stored result, timings included


def test_postprocess_with_a_job_id_finishes_the_job(redis_client, models):
    jobs = JobStore(redis_client, 60)
    released, forgotten = [], []
    finisher = JobFinisher(jobs, release=released.append, forget=forgotten.extend, default_model="tiny")
    stage = PostprocessStage(StageMemo(redis_client, slack_s=60), models, "tiny", finisher)
    now = time.time()
    jobs.create("f1", n_prompts=1, deadline=now + 60, now=now)
    out = stage.run(_generation("f1", now), job_id="f1", submitted_at=now)
    rec = jobs.get("f1")
    assert rec.status == JobStatus.SUCCEEDED and json.loads(rec.result_json) == out
    assert out["results"][0]["token_ids"] == [5, 6, 7, 8]
    assert released == ["f1"] and forgotten == ["f1-0"]


def test_tokenize_answers_a_clients_mistake_in_the_body():
    class TemplateError(Exception):  # jinja2's, by name
        pass

    def tokenize_view(**kw):
        if kw.get("messages") == "bad":
            raise TemplateError("roles must alternate")
        if kw.get("messages") == "bug":
            raise KeyError("bug")
        return {"tokens": [1, 2], "kw": kw}

    res = SimpleNamespace(input_processor=SimpleNamespace(tokenize_view=tokenize_view))

    def models(name):
        if name == "other":
            raise ModelNotFoundError("The model `other` does not exist", param="model")
        return res

    stage = TokenizeStage(models)
    body = {"prompt": "hi", "model": "tiny"}
    assert stage.run(body) == {"tokens": [1, 2], "kw": {"prompt": "hi"}}
    assert body == {"prompt": "hi", "model": "tiny"}  # the caller's body is left as it was
    assert stage.run({"prompt": "hi", "model": "other"})["error"] == {
        "type": "model_not_found", "message": "The model `other` does not exist", "param": "model"}
    assert stage.run({"messages": "bad"})["error"] == {
        "type": "invalid_request", "message": "chat template: roles must alternate", "param": "messages"}
    with pytest.raises(KeyError):
        stage.run({"messages": "bug"})
