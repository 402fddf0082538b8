"""InferenceProcessor with a fake engine: unit tests, no Celery, no model."""

import threading

import pytest

from llmpipe.engines.base import Engine, EngineOutput
from llmpipe.errors import EngineError
from llmpipe.messages import (
    ErrorReason,
    FinishReason,
    Logprob,
    SamplingParams,
    Stage,
    StructuredOutput,
    TokenizedRequest,
)
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


# -- request migration: what was emitted is never taken back --------------------------------
class SamplingEngine(Engine):
    """Emits a fresh 'sample' on every call (a counter, so no two attempts agree), token by
    token through on_tokens; a batch holding the poison prompt fails after ``fail_after`` tokens."""

    name = "sampling"
    supports_logprobs = True
    supports_structured_outputs = True

    def __init__(self, poison=(6, 6, 6), fail_after=3, eos=None):
        self.poison = list(poison)
        self.fail_after = fail_after
        self.calls = []
        self.next_token = 100
        self.eos_token_ids = [eos] if eos is not None else []

    def generate(self, batch, on_tokens=None):
        self.calls.append([(r.request_id, list(r.prompt_token_ids), r.params.max_tokens) for r in batch])
        poisoned = any(r.prompt_token_ids[: len(self.poison)] == self.poison for r in batch)
        steps = min(self.fail_after, max(r.params.max_tokens for r in batch)) if poisoned else max(r.params.max_tokens for r in batch)
        out = {r.request_id: [] for r in batch}
        for _ in range(steps):
            for r in batch:
                if len(out[r.request_id]) < r.params.max_tokens:
                    out[r.request_id].append(self.next_token)
                    self.next_token += 1
                    if on_tokens:
                        on_tokens(r.request_id, list(out[r.request_id]))
        if poisoned:
            raise EngineError("poison in the batch")
        return [EngineOutput(r.request_id, out[r.request_id], FinishReason.LENGTH,
                             logprobs=None if r.params.logprobs is None else [
                                 [Logprob(id=t, logprob=-1.0, rank=1)] for t in out[r.request_id]])
                for r in batch]

    def shutdown(self):
        pass


class SeenPublisher:
    def __init__(self):
        self.seen = {}
        self.prefix = {}

    def register(self, request_id, job_id, index, stream, prefix=None, **_):
        self.prefix[request_id] = list(prefix or [])
        self.seen.setdefault(request_id, [])

    def on_tokens(self, request_id, ids):
        self.seen[request_id].append(list(ids))

    def finish(self, request_id, final_ids=None, **_):
        pass


def _mk(i, ids, max_tokens=8):
    return TokenizedRequest(job_id="j", index=i, deadline=2000.0, enqueued_at=999.0, prompt_token_ids=list(ids),
                            params=SamplingParams(max_tokens=max_tokens, temperature=1.0))


def test_a_split_batch_resumes_each_request_from_what_it_streamed():
    eng = SamplingEngine(fail_after=3)
    pub = SeenPublisher()
    gate = threading.Barrier(2)
    p = InferenceProcessor(eng, window_s=5.0, max_size=2, company_expected=lambda: True, clock=Clock(), publisher=pub)
    reqs = [_mk(0, (1, 2)), _mk(1, (6, 6, 6))]
    out = [None, None]

    def run(i):
        gate.wait()
        out[i] = p.process(reqs[i])

    ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    [t.start() for t in ts]
    [t.join(10) for t in ts]
    p.shutdown()
    healthy = out[0]
    assert healthy.error is None and out[1].error.reason == ErrorReason.ENGINE_ERROR
    first = eng.calls[0]
    assert len(first) == 2  # they shared the batch that failed after 3 tokens
    streamed_first = pub.seen["j-0"][2]  # the 3 tokens of the failed attempt
    assert len(streamed_first) == 3
    # the retry continued from them: prompt + streamed ids, the rest of max_tokens
    retry = next(c for c in eng.calls[1:] if c[0][0] == "j-0")
    assert retry == [("j-0", [1, 2, *streamed_first], 5)]
    assert healthy.output_token_ids[:3] == streamed_first and len(healthy.output_token_ids) == 8
    # everything ever streamed is a prefix of the final output
    for ids in pub.seen["j-0"]:
        assert healthy.output_token_ids[: len(ids)] == ids
    assert healthy.prompt_tokens == 2


def test_a_redelivered_request_resumes_from_the_published_tokens():
    eng = SamplingEngine()
    pub = SeenPublisher()
    published = {"j": {0: [7, 8, 9]}}
    p = InferenceProcessor(eng, window_s=0.0, max_size=2, company_expected=lambda: False, clock=Clock(), publisher=pub,
                           published=lambda job_id: published[job_id])
    gen = p.process(_mk(0, (1, 2), max_tokens=5), resume=True)
    p.shutdown()
    assert pub.prefix["j-0"] == [7, 8, 9]
    assert eng.calls == [[("j-0", [1, 2, 7, 8, 9], 2)]]
    assert gen.output_token_ids[:3] == [7, 8, 9] and len(gen.output_token_ids) == 5


@pytest.mark.parametrize("published,max_tokens,finish", [([7, 8, 9], 3, FinishReason.LENGTH),
                                                         ([7, 2], 5, FinishReason.STOP)])
def test_a_request_whose_published_tokens_finish_it_does_not_run_again(published, max_tokens, finish):
    eng = SamplingEngine(eos=2)
    p = InferenceProcessor(eng, window_s=0.0, max_size=2, company_expected=lambda: False, clock=Clock(),
                           published=lambda job_id: {0: published})
    gen = p.process(_mk(0, (1, 5), max_tokens=max_tokens), resume=True)
    p.shutdown()
    assert eng.calls == [] and gen.output_token_ids == published and gen.finish_reason == finish


def test_without_resume_nothing_is_read():
    eng = SamplingEngine()

    def boom(job_id):
        raise AssertionError("read on a first delivery")

    p = InferenceProcessor(eng, window_s=0.0, max_size=2, company_expected=lambda: False, clock=Clock(), published=boom)
    assert p.process(_mk(0, (1, 2), max_tokens=2)).output_token_ids == [100, 101]
    p.shutdown()


# -- migration and what cannot resume exactly: logprobs, grammars ---------------------------
def _shared_failed_batch(p, reqs):
    out = [None] * len(reqs)
    gate = threading.Barrier(len(reqs))

    def run(i):
        gate.wait()
        out[i] = p.process(reqs[i])

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(reqs))]
    [t.start() for t in ts]
    [t.join(10) for t in ts]
    p.shutdown()
    return out


def test_a_split_batch_runs_a_logprobs_request_again_whole_and_never_publishes_it():
    # Its first 3 tokens' logprobs died with the failed attempt: resuming would answer ids
    # without them. It was not published, so running it whole takes nothing back.
    eng = SamplingEngine(fail_after=3)
    pub = SeenPublisher()
    p = InferenceProcessor(eng, window_s=5.0, max_size=2, company_expected=lambda: True, clock=Clock(), publisher=pub)
    lp = _mk(0, (1, 2)).model_copy(update={"params": SamplingParams(max_tokens=8, temperature=1.0, logprobs=2)})
    out = _shared_failed_batch(p, [lp, _mk(1, (6, 6, 6))])
    gen = out[0]
    assert len(eng.calls[0]) == 2  # the shared batch failed after 3 tokens
    retry = next(c for c in eng.calls[1:] if c[0][0] == "j-0")
    assert retry == [("j-0", [1, 2], 8)]  # the original prompt, all of max_tokens
    assert gen.error is None and len(gen.output_token_ids) == 8
    assert [pos[0].id for pos in gen.logprobs] == gen.output_token_ids  # one position per id, aligned
    assert "j-0" not in pub.seen and "j-0" not in pub.prefix


def test_a_redelivered_logprobs_request_runs_whole():
    eng = SamplingEngine()
    p = InferenceProcessor(eng, window_s=0.0, max_size=2, company_expected=lambda: False, clock=Clock(),
                           publisher=SeenPublisher(), published=lambda job_id: {0: [7, 8, 9]})
    req = _mk(0, (1, 2)).model_copy(update={"params": SamplingParams(max_tokens=5, prompt_logprobs=1)})
    gen = p.process(req, resume=True)
    p.shutdown()
    assert eng.calls == [[("j-0", [1, 2], 5)]] and len(gen.output_token_ids) == 5


def test_a_grammar_request_runs_again_whole_unless_its_stream_began():
    grammar = SamplingParams(max_tokens=8, temperature=1.0, structured=StructuredOutput(json_object=True))
    for stream in (False, True):
        eng = SamplingEngine(fail_after=3)
        pub = SeenPublisher()
        p = InferenceProcessor(eng, window_s=5.0, max_size=2, company_expected=lambda: True, clock=Clock(), publisher=pub)
        req = _mk(0, (1, 2)).model_copy(update={"params": grammar, "stream": stream})
        gen = _shared_failed_batch(p, [req, _mk(1, (6, 6, 6))])[0]
        retries = [c for c in eng.calls[1:] if c[0][0] == "j-0"]
        if stream:  # 3 ids were streamed; the grammar cannot continue after them, nor take them back
            assert len(pub.seen["j-0"]) == 3 and retries == []
            assert gen.error.reason == ErrorReason.ENGINE_ERROR and "structured output" in gen.error.message
        else:
            assert retries == [[("j-0", [1, 2], 8)]] and gen.error is None and len(gen.output_token_ids) == 8
            assert "j-0" not in pub.seen


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
    p = InferenceProcessor(eng, window_s=0.0, max_size=4, company_expected=lambda: True, clock=Clock(),
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
    p = InferenceProcessor(eng, window_s=0.0, max_size=4, company_expected=lambda: False, clock=Clock(),
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

