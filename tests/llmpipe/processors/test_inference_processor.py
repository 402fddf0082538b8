"""InferenceProcessor with a fake engine: unit tests, no Celery, no model."""

import threading

import pytest

from llmpipe.engines.base import Engine, EngineOutput
from llmpipe.errors import EngineError
from llmpipe.messages import (
    ErrorReason,
    FinishReason,
    SamplingParams,
    Stage,
    TokenizedRequest,
)
from llmpipe.processors.inference_processor import InferenceProcessor
from tests.harness.clock import ManualClock
from tests.harness.together import call_together


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


def _req(i, ids=(1, 2, 3), deadline=2000.0):
    return TokenizedRequest(job_id="j", index=i, deadline=deadline, enqueued_at=999.0,
                            prompt_token_ids=list(ids), params=SamplingParams(max_tokens=2))


def test_generates_and_stamps_inference_timing():
    eng = FakeEngine()
    p = InferenceProcessor(eng, window_s=0.0, max_size=4, company_expected=lambda: False, clock=ManualClock())
    gen = p.process(_req(0))
    assert gen.output_token_ids == [3, 2] and gen.prompt_tokens == 3 and gen.batch_size == 1
    assert gen.timings[-1].stage == Stage.INFERENCE and gen.error is None
    p.shutdown()


def test_expired_work_never_reaches_the_engine():
    eng = FakeEngine()
    p = InferenceProcessor(eng, window_s=0.0, max_size=4, company_expected=lambda: False, clock=ManualClock(5000.0))
    gen = p.process(_req(0))
    assert gen.error.reason == ErrorReason.EXPIRED and gen.finish_reason == FinishReason.EXPIRED
    assert eng.batches == []
    p.shutdown()


def test_poison_request_fails_alone_in_a_shared_batch():
    eng = FakeEngine(poison=[6, 6, 6])
    p = InferenceProcessor(eng, window_s=5.0, max_size=6, company_expected=lambda: True, clock=ManualClock())
    out = call_together(p.process, [_req(i, ids=(6, 6, 6) if i == 3 else (i, i + 1)) for i in range(6)])
    assert eng.batches[0] and len(eng.batches[0]) == 6  # they shared one batch first
    assert out[3].error.reason == ErrorReason.ENGINE_ERROR
    assert all(out[i].error is None and out[i].output_token_ids for i in range(6) if i != 3)
    p.shutdown()


def test_upstream_error_passes_through_without_engine():
    from llmpipe.messages import StageError

    eng = FakeEngine()
    p = InferenceProcessor(eng, window_s=0.0, max_size=4, clock=ManualClock())
    req = _req(0).model_copy(update={"error": StageError(reason=ErrorReason.CONTEXT_LENGTH_EXCEEDED, message="x")})
    gen = p.process(req)
    assert gen.error.reason == ErrorReason.CONTEXT_LENGTH_EXCEEDED and eng.batches == []
    p.shutdown()


@pytest.mark.parametrize("continuous", [True, False])
def test_concurrency_of_batches_follows_engine_kind(continuous):
    eng = FakeEngine()
    eng.continuous = continuous
    p = InferenceProcessor(eng, window_s=0.0, max_size=4, clock=ManualClock())
    assert p.batcher.concurrent_batches == (4 if continuous else 1)  # max_size=4
    p.shutdown()


# -- request migration: what was emitted is never taken back --------------------------------


class DownRedis:
    """A Redis client whose every command fails as when the server is restarting."""

    def __init__(self):
        self.calls: list[str] = []  # the commands tried, in order

    def __getattr__(self, name):
        import redis

        def fail(*_a, **_k):
            self.calls.append(name)
            raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

        return fail


def test_a_redis_outage_during_a_batch_neither_fails_nor_wedges_it():
    # Every Redis call of the inference path fails: the cancellation lookup before the
    # engine, the token stream, the published ids of a resumed request. The batch still
    # runs, every request gets its generation, and nothing is left waiting on a future.
    from llmpipe.jobs import cancel
    from llmpipe.jobs.streaming import TokenPublisher, read_published

    r = DownRedis()
    pub = TokenPublisher(r, flush_s=3600)  # flushes only when a request finishes
    eng = FakeEngine()
    p = InferenceProcessor(eng, window_s=0.0, max_size=4, company_expected=lambda: True, clock=ManualClock(),
                           publisher=pub, cancelled_jobs=lambda ids: cancel.cancelled(r, ids),
                           published=lambda job_id: read_published(r, job_id))
    reqs = [_req(i, ids=(i + 1, 7, 8)) for i in range(4)]
    out: dict[int, object] = {}

    def run(req):
        out[req.index] = p.process(req, resume=req.index == 0)

    threads = [threading.Thread(target=run, args=(q,)) for q in reqs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a request still waits on its batch"
    assert sorted(out) == [0, 1, 2, 3]
    assert all(g.error is None and g.output_token_ids == [8, 7] for g in out.values()), out
    assert sum(len(b) for b in eng.batches) == 4  # the engine ran each request once
    # The lookups were made, and failed: the resumed request's published ids once, and the
    # cancellations before each batch the engine ran (how many batches is up to timing).
    assert r.calls.count("xrange") == 1, r.calls
    assert r.calls.count("mget") == len(eng.batches) >= 1, r.calls
    assert p.batcher.pending() == 0
    p.shutdown()
    pub.close()


def test_a_continuous_engine_runs_at_most_the_batch_lane_slots_and_an_interactive_request_passes():
    """vLLM never preempts a running request for a waiting one, so the batcher keeps batch-lane
    requests to their slots and an interactive request reaches the engine at once."""
    cond = threading.Condition()
    released: set[str] = set()

    class GatedEngine(FakeEngine):
        continuous = True

        def generate(self, batch, on_tokens=None):
            with cond:
                self.batches.append([r.request_id for r in batch])
                cond.notify_all()
                cond.wait_for(lambda: all(r.request_id in released for r in batch), timeout=10)
            return [EngineOutput(r.request_id, [1], FinishReason.LENGTH) for r in batch]

    eng = GatedEngine()
    p = InferenceProcessor(eng, window_s=0.0, max_size=4, company_expected=lambda: False, clock=ManualClock(),
                           batch_lane=lambda r: r.priority >= 10, batch_lane_slots=1)

    def req(i, priority):
        return _req(i).model_copy(update={"priority": priority})

    ts = [threading.Thread(target=p.process, args=(req(i, 10),)) for i in (0, 1)]
    try:
        [t.start() for t in ts]
        with cond:
            assert cond.wait_for(lambda: len(eng.batches) == 1, timeout=5)
        first = eng.batches[0]
        assert first in (["j-0"], ["j-1"])  # one batch-lane request: its one slot
        inter = threading.Thread(target=p.process, args=(req(2, 0),))
        inter.start()
        with cond:
            assert cond.wait_for(lambda: len(eng.batches) == 2, timeout=5)
            assert eng.batches[1] == ["j-2"]  # past the batch-lane request the cap holds back
            released.update({"j-2", *first})
            cond.notify_all()
            assert cond.wait_for(lambda: len(eng.batches) == 3, timeout=5)
            assert eng.batches[2] == [{"j-0": "j-1", "j-1": "j-0"}[first[0]]]
            released.update({"j-0", "j-1"})
            cond.notify_all()
        inter.join(5)
        [t.join(5) for t in ts]
    finally:
        with cond:
            released.update({"j-0", "j-1", "j-2"})
            cond.notify_all()
        p.shutdown()


def test_the_next_batch_lane_request_enters_the_engine_at_the_first_token_of_the_one_before():
    """batch_lane_starting 1: batch-lane requests go through their prefill one at a time, so
    no engine step carries several of them; the first token (on_tokens) lets the next one in."""
    cond = threading.Condition()
    emit: set[str] = set()
    released: set[str] = set()

    class PrefillingEngine(FakeEngine):
        continuous = True

        def generate(self, batch, on_tokens=None):
            [r] = batch
            with cond:
                self.batches.append(r.request_id)
                cond.notify_all()
                cond.wait_for(lambda: r.request_id in emit, timeout=10)
            on_tokens(r.request_id, [1])  # its prefill is done
            with cond:
                cond.wait_for(lambda: r.request_id in released, timeout=10)
            return [EngineOutput(r.request_id, [1], FinishReason.LENGTH)]

    eng = PrefillingEngine()
    p = InferenceProcessor(eng, window_s=0.0, max_size=4, company_expected=lambda: False, clock=ManualClock(),
                           batch_lane=lambda r: r.priority >= 10, batch_lane_slots=2, batch_lane_starting=1)
    everyone = {"j-0", "j-1", "j-2"}
    ts = [threading.Thread(target=p.process, args=(_req(i).model_copy(update={"priority": 10}),)) for i in (0, 1)]
    try:
        [t.start() for t in ts]
        with cond:
            assert cond.wait_for(lambda: len(eng.batches) == 1, timeout=5)
        first = eng.batches[0]
        ts.append(threading.Thread(target=p.process, args=(_req(2),)))  # interactive: passes both
        ts[-1].start()
        with cond:
            assert cond.wait_for(lambda: len(eng.batches) == 2, timeout=5)
            assert eng.batches[1] == "j-2" and p.batcher.pending() == 1  # two slots, but one in its prefill
            emit.add(first)
            cond.notify_all()
            assert cond.wait_for(lambda: len(eng.batches) == 3, timeout=5)  # while the first still runs
            assert first not in released
            emit.update(everyone)
            released.update(everyone)
            cond.notify_all()
        [t.join(5) for t in ts]
        assert not any(t.is_alive() for t in ts)
    finally:
        with cond:
            emit.update(everyone)
            released.update(everyone)
            cond.notify_all()
        p.shutdown()
