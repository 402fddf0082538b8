"""VllmEngine on the tiny model: one AsyncLLM for the session (see conftest.py)."""

from __future__ import annotations

import threading
import time

import pytest

from llmpipe.engines.base import EngineRequest
from llmpipe.errors import EngineError
from llmpipe.messages import FinishReason, SamplingParams
from tests.harness.engine import TEST_ENGINE

# Different lengths in one batch: left padding (HF) against paged attention (vLLM).
PROMPTS = [[17], [300, 301, 302], [900 + i for i in range(9)], [40 + 7 * i for i in range(40)], list(range(100, 300))]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, **kw)


def test_engine_properties(vllm_engine, tiny_model):
    assert vllm_engine.continuous is True
    assert vllm_engine.max_model_len == 1024
    # The EOS ids come from the model's generation_config.json (and config.json).
    assert vllm_engine.eos_token_ids == [1, 4]
    assert vllm_engine._sampling_params(greedy(3)).stop_token_ids == [1, 4]
    assert vllm_engine._sampling_params(greedy(3, ignore_eos=True, stop_token_ids=[9])).stop_token_ids == [9]


def test_greedy_ids_equal_transformers(vllm_engine, hf_engine):
    batch = [EngineRequest(f"g{i}", p, greedy(24)) for i, p in enumerate(PROMPTS)]
    v = vllm_engine.generate(batch)
    h = hf_engine.generate(batch)
    assert [o.request_id for o in v] == [r.request_id for r in batch]
    assert [o.token_ids for o in v] == [o.token_ids for o in h]
    assert [o.finish_reason for o in v] == [o.finish_reason for o in h]


def test_vllms_extra_sampling_fields_give_the_same_greedy_ids_in_transformers(vllm_engine, hf_engine, tiny_tokenizer):
    """The transformers engine processes the logits as vLLM does (llmpipe/engines/hf_sampling.py):
    penalties, logit_bias, allowed_token_ids, min_tokens and bad_words change the greedy ids
    of both engines the same way."""
    from llmpipe.processors.prompt_checks import bad_words_token_ids

    (ref,) = vllm_engine.generate([EngineRequest("x-ref", PROMPTS[2], greedy(16))])
    # A word the output holds as one of the token sequences vLLM forbids for it.
    vocab_max = len(tiny_tokenizer) - 1
    word = next(w for w in (tiny_tokenizer.decode([t]) for t in ref.token_ids)
                if any(seq == [t] for t in ref.token_ids for seq in bad_words_token_ids(tiny_tokenizer, [w], vocab_max)))
    fields = [dict(repetition_penalty=1.5), dict(presence_penalty=1.5, frequency_penalty=0.7),
              dict(logit_bias={ref.token_ids[1]: -100.0, 300: 5.0}), dict(allowed_token_ids=[262, 290, 300, 4]),
              dict(min_tokens=12, stop_token_ids=[ref.token_ids[5]]),
              dict(bad_words=[word], bad_words_token_ids=bad_words_token_ids(tiny_tokenizer, [word], vocab_max))]
    batch = [EngineRequest(f"x{i}", PROMPTS[2], greedy(16, **f)) for i, f in enumerate(fields)]
    v, h = vllm_engine.generate(batch), hf_engine.generate(batch)
    for f, vo, ho in zip(fields, v, h, strict=True):
        assert vo.token_ids == ho.token_ids, f
        assert vo.token_ids != ref.token_ids, f  # the field did change the output
    assert set(v[3].token_ids) <= {262, 290, 300, 4}


def _close(a, b, tol=1e-4):
    return all(x.id == y.id and x.rank == y.rank and (x.logprob is None) == (y.logprob is None)
               and (x.logprob is None or abs(x.logprob - y.logprob) <= tol) for x, y in zip(a, b, strict=True))


def test_logprobs_equal_transformers(vllm_engine, hf_engine):
    """Both engines give vLLM's per-position lists: the sampled token (with its rank) first,
    then the top k, from the raw logits; prompt positions start with the first token, unscored."""
    batch = [EngineRequest(f"lp{i}", p, greedy(6, logprobs=3, prompt_logprobs=2)) for i, p in enumerate(PROMPTS[:3])]
    batch.append(EngineRequest("lp-none", PROMPTS[3], greedy(4)))
    v, h = vllm_engine.generate(batch), hf_engine.generate(batch)
    for vo, ho, req in zip(v[:3], h[:3], batch[:3], strict=True):
        assert vo.token_ids == ho.token_ids
        assert len(vo.logprobs) == len(vo.token_ids) and len(vo.prompt_logprobs) == len(req.prompt_token_ids)
        assert [p[0].id for p in vo.logprobs] == vo.token_ids
        assert vo.prompt_logprobs[0][0].id == req.prompt_token_ids[0] and vo.prompt_logprobs[0][0].logprob is None
        assert all(_close(a, b) for a, b in zip(vo.logprobs, ho.logprobs, strict=True))
        assert all(_close(a, b) for a, b in zip(vo.prompt_logprobs, ho.prompt_logprobs, strict=True))
    assert v[3].logprobs is None and v[3].prompt_logprobs is None and h[3].logprobs is None


def test_structured_output_is_json_and_a_bad_schema_is_the_clients_fault(vllm_engine, tiny_tokenizer):
    from llmpipe.errors import EngineBadRequestError
    from llmpipe.messages import StructuredOutput

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
    (o,) = vllm_engine.generate([EngineRequest("so", PROMPTS[1], greedy(40, structured=StructuredOutput(json_schema=schema)))])
    text = tiny_tokenizer.decode(o.token_ids, skip_special_tokens=True)
    assert "".join(text.split()).startswith('{"a":'), text  # the grammar allows nothing else (random weights)
    with pytest.raises(EngineBadRequestError):
        vllm_engine.generate([EngineRequest("so-bad", PROMPTS[1], greedy(5, structured=StructuredOutput(
            json_schema={"type": "no-such-type"})))])


def test_stop_token_is_the_stop_reason(vllm_engine, hf_engine):
    (ref,) = vllm_engine.generate([EngineRequest("st-ref", PROMPTS[3], greedy(10))])
    stop = ref.token_ids[2]
    req = EngineRequest("st", PROMPTS[3], greedy(10, stop_token_ids=[stop]))
    for engine in (vllm_engine, hf_engine):
        (o,) = engine.generate([req])
        assert o.stop_token == stop and o.finish_reason is FinishReason.STOP
    assert ref.stop_token is None


def test_vllm_gets_ids_and_gives_ids(vllm_engine):
    """vLLM loads the tokenizer (skip_tokenizer_init=False) for grammars only: a prompt goes
    in as the ids given, even ones no text would tokenize to, and outputs are not decoded."""
    from llmpipe.engines.vllm_args import OWNED, SKIP_TOKENIZER_INIT

    assert vllm_engine._args.skip_tokenizer_init is SKIP_TOKENIZER_INIT is False and "skip_tokenizer_init" in OWNED
    assert vllm_engine._sampling_params(greedy(3)).detokenize is False
    ids = [262, 262, 262, 4, 3, 262]  # an EOS id in the middle: no tokenizer makes this from text
    (o,) = vllm_engine.generate([EngineRequest("ids-in", ids, greedy(3, prompt_logprobs=0))])
    assert [pos[0].id for pos in o.prompt_logprobs] == ids and len(o.token_ids) == 3


def test_max_tokens_and_length(vllm_engine):
    out = vllm_engine.generate([EngineRequest("m1", PROMPTS[1], greedy(1)), EngineRequest("m7", PROMPTS[2], greedy(7))])
    assert [len(o.token_ids) for o in out] == [1, 7]
    assert all(o.finish_reason is FinishReason.LENGTH and o.first_token_at for o in out)


def test_stop_token_ids(vllm_engine):
    (ref,) = vllm_engine.generate([EngineRequest("ref", PROMPTS[3], greedy(10))])
    stop = ref.token_ids[4]
    cut = ref.token_ids.index(stop) + 1
    (o,) = vllm_engine.generate([EngineRequest("stop", PROMPTS[3], greedy(10, stop_token_ids=[stop]))])
    assert o.token_ids == ref.token_ids[:cut]  # the stop token is part of the output
    assert o.finish_reason is FinishReason.STOP


def test_on_tokens_growing_prefixes(vllm_engine):
    seen: dict[str, list[list[int]]] = {}
    lock = threading.Lock()

    def on_tokens(rid, toks):
        with lock:
            seen.setdefault(rid, []).append(toks)

    out = vllm_engine.generate(
        [EngineRequest("a", PROMPTS[0], greedy(6)), EngineRequest("b", PROMPTS[4], greedy(4))], on_tokens=on_tokens
    )
    for o in out:
        calls = seen[o.request_id]
        assert calls[-1] == o.token_ids
        for shorter, longer in zip(calls, calls[1:]):
            assert len(shorter) < len(longer) and longer[: len(shorter)] == shorter


def test_concurrent_generate_calls(vllm_engine):
    expected = {i: o.token_ids for i, o in enumerate(vllm_engine.generate(
        [EngineRequest(f"e{i}", p, greedy(8)) for i, p in enumerate(PROMPTS)]))}
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def call(t: int):
        try:
            batch = [EngineRequest(f"t{t}-{i}", PROMPTS[i], greedy(8)) for i in (t % 5, (t + 2) % 5)]
            results[t] = vllm_engine.generate(batch)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=call, args=(t,)) for t in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(results) == 5
    for t, outs in results.items():
        assert [o.token_ids for o in outs] == [expected[t % 5], expected[(t + 2) % 5]]


def test_continuous_batching_short_request_overtakes_long(vllm_engine):
    progress: list[int] = []
    started = threading.Event()

    def on_tokens(rid, toks):
        progress.append(len(toks))
        if len(toks) >= 3:
            started.set()

    long_out: list = []
    t = threading.Thread(target=lambda: long_out.extend(vllm_engine.generate(
        [EngineRequest("long", PROMPTS[1], greedy(900, ignore_eos=True))], on_tokens=on_tokens)))
    t.start()
    try:
        assert started.wait(60)
        (short,) = vllm_engine.generate([EngineRequest("short", PROMPTS[2], greedy(3))])
        assert len(short.token_ids) == 3
        assert progress[-1] < 900  # the long request was still running: the short one joined its batch
        stats = vllm_engine.stats()
        assert stats["inflight"] >= 1 and "running" in stats
    finally:
        vllm_engine.abort(["long"])
        t.join(120)
    assert long_out and long_out[0].finish_reason is FinishReason.CANCELLED


def test_abort_returns_cancelled(vllm_engine):
    seen = threading.Event()
    out: list = []

    def on_tokens(rid, toks):
        if len(toks) >= 2:
            seen.set()

    t = threading.Thread(target=lambda: out.extend(vllm_engine.generate(
        [EngineRequest("ab", PROMPTS[2], greedy(900, ignore_eos=True)),
         EngineRequest("keep", PROMPTS[0], greedy(5))], on_tokens=on_tokens)))
    t0 = time.monotonic()
    t.start()
    assert seen.wait(60)
    vllm_engine.abort(["ab", "not-running"])
    t.join(120)
    assert not t.is_alive()
    ab, keep = out
    assert ab.finish_reason is FinishReason.CANCELLED and 2 <= len(ab.token_ids) < 900
    assert keep.finish_reason is FinishReason.LENGTH and len(keep.token_ids) == 5
    assert time.monotonic() - t0 < 60


def test_bad_requests_raise_engine_error(vllm_engine):
    with pytest.raises(EngineError) as e:
        vllm_engine.generate([EngineRequest("long", [5] * 1024, greedy(2))])
    assert not e.value.transient
    with pytest.raises(EngineError):
        vllm_engine.generate([EngineRequest("oov", [10**7], greedy(2))])
    # The engine still works afterwards.
    assert len(vllm_engine.generate([EngineRequest("ok", PROMPTS[0], greedy(2))])[0].token_ids) == 2


def test_vllm_errors_are_translated(vllm_engine):
    import torch
    from vllm.v1.engine.exceptions import EngineDeadError as VllmDead
    from vllm.v1.engine.exceptions import EngineGenerateError

    from llmpipe.errors import EngineDeadError

    assert isinstance(vllm_engine._translate(VllmDead()), EngineDeadError)
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory")
        except torch.OutOfMemoryError as oom:
            raise EngineGenerateError() from oom
    except EngineGenerateError as wrapped:
        err = vllm_engine._translate(wrapped)
    assert type(err) is EngineError and err.transient
    plain = vllm_engine._translate(ValueError("bad"))
    assert type(plain) is EngineError and not plain.transient


def test_failed_start_raises_engine_error_and_stops_its_thread(tmp_path):
    pytest.importorskip("vllm")
    from llmpipe.engines.vllm_engine import VllmEngine

    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(EngineError):
        # a folder with no model in it; the tests' engine settings, since the engine puts its KV
        # cache size into this process's environment, where the next test's stacks inherit it
        VllmEngine(str(tmp_path), **TEST_ENGINE)
    leftover = [t for t in threading.enumerate() if t.ident not in before and t.name == "vllm-engine-loop"]
    assert not leftover


def test_requests_carry_their_priority_into_a_priority_scheduler(vllm_engine):
    # vLLM refuses a non-zero priority unless scheduling_policy is "priority" (llmpipe/jobs/lanes.py)
    assert vllm_engine._args.scheduling_policy == "priority"
    outs = vllm_engine.generate([EngineRequest("p-batch", PROMPTS[1], greedy(4), priority=10),
                                 EngineRequest("p-inter", PROMPTS[1], greedy(4), priority=-3)])
    assert [len(o.token_ids) for o in outs] == [4, 4] and outs[0].token_ids == outs[1].token_ids
