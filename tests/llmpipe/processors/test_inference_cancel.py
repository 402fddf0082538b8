"""InferenceProcessor's side of cancellation (llmpipe/jobs/cancel.py reports a cancelled job by
broadcast and by the flag sweep; the processor aborts its requests in the engine once)."""

import threading

from llmpipe.engines.base import Engine, EngineOutput
from llmpipe.messages import ErrorReason, FinishReason, SamplingParams, TokenizedRequest
from llmpipe.processors.inference_processor import InferenceProcessor


def _req(i):
    return TokenizedRequest(job_id="j", index=i, deadline=2000.0, enqueued_at=999.0,
                            prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=2))


class HeldEngine(Engine):
    """Holds every batch until abort() (which ends it cancelled) or release."""

    name = "held"

    def __init__(self):
        self.started, self.go, self.aborted = threading.Event(), threading.Event(), []

    def generate(self, batch, on_tokens=None):
        self.started.set()
        assert self.go.wait(10)
        finish = FinishReason.CANCELLED if self.aborted else FinishReason.LENGTH
        return [EngineOutput(r.request_id, [7], finish) for r in batch]

    def abort(self, request_ids):
        self.aborted += request_ids
        self.go.set()

    def shutdown(self):
        pass


def test_a_job_reported_cancelled_twice_is_aborted_once_and_leaves_the_running_list():
    # The cancel broadcast and the flag sweep (llmpipe/jobs/cancel.py) both report a job.
    eng = HeldEngine()
    p = InferenceProcessor(eng, window_s=0.0, max_size=4, company_expected=lambda: False, clock=lambda: 1000.0)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("gen", p.process(_req(0))))
    t.start()
    assert eng.started.wait(10)
    assert p.running_jobs() == ["j"]
    rid = _req(0).request_id
    assert p.cancel("j") == [rid]
    assert p.cancel("j") == [] and eng.aborted == [rid]
    assert p.running_jobs() == []
    t.join(10)
    assert out["gen"].error.reason == ErrorReason.CANCELLED
    assert p.running_jobs() == [] and p.cancel("j") == []
    p.shutdown()
