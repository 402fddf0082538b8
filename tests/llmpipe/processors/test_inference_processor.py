"""InferenceProcessor with a fake engine: unit tests, no Celery, no model."""

import threading

import pytest

from llmpipe.engines.base import Engine, EngineOutput
from llmpipe.errors import EngineError
from llmpipe.messages import ErrorReason, FinishReason, SamplingParams, Stage, TokenizedRequest
from llmpipe.processors.inference_processor import InferenceProcessor


class FakeEngine(Engine):
    name = "fake"

    def __init__(self, poison=None):
        self.batches = []
        self.poison = poison
        self.aborted = []

    def generate(self, batch, on_tokens=None):
        self.batches.append([r.request_id for r in batch])
        if self.poison is not None and any(r.prompt_token_ids == self.poison for r in batch):
            raise EngineError("bad request in batch")
        return [EngineOutput(r.request_id, list(reversed(r.prompt_token_ids))[: r.params.max_tokens], FinishReason.LENGTH) for r in batch]

    def abort(self, request_ids):
        self.aborted += request_ids

    def shutdown(self):
        pass


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def _req(i, ids=(1, 2, 3), deadline=2000.0):
    return TokenizedRequest(job_id="j", index=i, deadline=deadline, enqueued_at=999.0,
                            prompt_token_ids=list(ids), params=SamplingParams(max_tokens=2))


def test_generates_and_stamps_inference_timing():
    eng = FakeEngine()
    p = InferenceProcessor(eng, window_s=0.0, max_size=4, company_expected=lambda: False, clock=Clock())
    gen = p.process(_req(0))
    assert gen.output_token_ids == [3, 2] and gen.prompt_tokens == 3 and gen.batch_size == 1
    assert gen.timings[-1].stage == Stage.INFERENCE and gen.error is None
    p.shutdown()


def test_expired_work_never_reaches_the_engine():
    eng = FakeEngine()
    p = InferenceProcessor(eng, window_s=0.0, max_size=4, company_expected=lambda: False, clock=Clock(5000.0))
    gen = p.process(_req(0))
    assert gen.error.reason == ErrorReason.EXPIRED and gen.finish_reason == FinishReason.EXPIRED
    assert eng.batches == []
    p.shutdown()


def test_poison_request_fails_alone_in_a_shared_batch():
    eng = FakeEngine(poison=[6, 6, 6])
    gate = threading.Barrier(6)
    p = InferenceProcessor(eng, window_s=5.0, max_size=6, company_expected=lambda: True, clock=Clock())
    reqs = [_req(i, ids=(6, 6, 6) if i == 3 else (i, i + 1)) for i in range(6)]
    out = [None] * 6

    def run(i):
        gate.wait()
        out[i] = p.process(reqs[i])

    ts = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    [t.start() for t in ts]
    [t.join(10) for t in ts]
    assert eng.batches[0] and len(eng.batches[0]) == 6  # they shared one batch first
    assert out[3].error.reason == ErrorReason.ENGINE_ERROR
    assert all(out[i].error is None and out[i].output_token_ids for i in range(6) if i != 3)
    p.shutdown()


def test_upstream_error_passes_through_without_engine():
    from llmpipe.messages import StageError

    eng = FakeEngine()
    p = InferenceProcessor(eng, window_s=0.0, max_size=4, clock=Clock())
    req = _req(0).model_copy(update={"error": StageError(reason=ErrorReason.CONTEXT_LENGTH_EXCEEDED, message="x")})
    gen = p.process(req)
    assert gen.error.reason == ErrorReason.CONTEXT_LENGTH_EXCEEDED and eng.batches == []
    p.shutdown()


@pytest.mark.parametrize("continuous", [True, False])
def test_concurrency_of_batches_follows_engine_kind(continuous):
    eng = FakeEngine()
    eng.continuous = continuous
    p = InferenceProcessor(eng, window_s=0.0, max_size=4, clock=Clock())
    assert p.batcher.concurrent_batches == (4 if continuous else 1)  # max_size=4
    p.shutdown()
