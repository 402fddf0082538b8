"""InferenceProcessor's resume of a request that a split or redelivered batch had begun: it
goes on from the tokens it already streamed, or runs again whole where it must. Unit tests
with a fake engine, no Celery, no model."""

import pytest

from llmpipe.engines.base import Engine, EngineOutput
from llmpipe.errors import EngineError
from llmpipe.messages import (
    ErrorReason,
    FinishReason,
    Logprob,
    SamplingParams,
    StructuredOutput,
    TokenizedRequest,
)
from llmpipe.processors.inference_processor import InferenceProcessor
from tests.harness.clock import ManualClock
from tests.harness.together import call_together


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


def _shared_failed_batch(p, reqs):
    """Runs ``reqs`` at once, so that they share one batch (the poison prompt in it fails that
    batch part-way), then shuts ``p`` down; their results, in order."""
    out = call_together(p.process, reqs)
    p.shutdown()
    return out


def test_a_split_batch_resumes_each_request_from_what_it_streamed():
    eng = SamplingEngine(fail_after=3)
    pub = SeenPublisher()
    p = InferenceProcessor(eng, window_s=5.0, max_size=2, company_expected=lambda: True,
                           clock=ManualClock(), publisher=pub)
    out = _shared_failed_batch(p, [_mk(0, (1, 2)), _mk(1, (6, 6, 6))])
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
    p = InferenceProcessor(eng, window_s=0.0, max_size=2, company_expected=lambda: False,
                           clock=ManualClock(), publisher=pub,
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
    p = InferenceProcessor(eng, window_s=0.0, max_size=2, company_expected=lambda: False, clock=ManualClock(),
                           published=lambda job_id: {0: published})
    gen = p.process(_mk(0, (1, 5), max_tokens=max_tokens), resume=True)
    p.shutdown()
    assert eng.calls == [] and gen.output_token_ids == published and gen.finish_reason == finish


def test_without_resume_nothing_is_read():
    eng = SamplingEngine()

    def boom(job_id):
        raise AssertionError("read on a first delivery")

    p = InferenceProcessor(eng, window_s=0.0, max_size=2, company_expected=lambda: False,
                           clock=ManualClock(), published=boom)
    assert p.process(_mk(0, (1, 2), max_tokens=2)).output_token_ids == [100, 101]
    p.shutdown()


# -- migration and what cannot resume exactly: logprobs, grammars ---------------------------


def test_a_split_batch_runs_a_logprobs_request_again_whole_and_never_publishes_it():
    # Its first 3 tokens' logprobs died with the failed attempt: resuming would answer ids
    # without them. It was not published, so running it whole takes nothing back.
    eng = SamplingEngine(fail_after=3)
    pub = SeenPublisher()
    p = InferenceProcessor(eng, window_s=5.0, max_size=2, company_expected=lambda: True,
                           clock=ManualClock(), publisher=pub)
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
    p = InferenceProcessor(eng, window_s=0.0, max_size=2, company_expected=lambda: False, clock=ManualClock(),
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
        p = InferenceProcessor(eng, window_s=5.0, max_size=2, company_expected=lambda: True,
                               clock=ManualClock(), publisher=pub)
        req = _mk(0, (1, 2)).model_copy(update={"params": grammar, "stream": stream})
        gen = _shared_failed_batch(p, [req, _mk(1, (6, 6, 6))])[0]
        retries = [c for c in eng.calls[1:] if c[0][0] == "j-0"]
        if stream:  # 3 ids were streamed; the grammar cannot continue after them, nor take them back
            assert len(pub.seen["j-0"]) == 3 and retries == []
            assert gen.error.reason == ErrorReason.ENGINE_ERROR and "structured output" in gen.error.message
        else:
            assert retries == [[("j-0", [1, 2], 8)]] and gen.error is None and len(gen.output_token_ids) == 8
            assert "j-0" not in pub.seen
