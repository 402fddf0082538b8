"""TransformersEngine on the tiny model (loads in a few seconds)."""

from __future__ import annotations

import json
import shutil

import pytest

from llmpipe.engines.base import EngineRequest
from llmpipe.errors import EngineError
from llmpipe.messages import FinishReason, SamplingParams

PROMPTS = [[17], [300, 301, 302], [900 + i for i in range(9)], [40 + 7 * i for i in range(40)]]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, **kw)


def test_batched_equals_one_by_one(hf_engine):
    batch = [EngineRequest(f"p{i}", p, greedy(12)) for i, p in enumerate(PROMPTS)]
    together = hf_engine.generate(batch)
    assert [o.request_id for o in together] == [r.request_id for r in batch]
    alone = [hf_engine.generate([r])[0] for r in batch]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    for o in together:
        assert len(o.token_ids) == 12 and o.finish_reason is FinishReason.LENGTH and o.first_token_at


def test_each_batch_is_timed_to_its_first_token_and_per_decode_step(hf_engine, caplog):
    batch = [EngineRequest("t0", PROMPTS[1], greedy(5)), EngineRequest("t1", PROMPTS[3], greedy(3))]
    with caplog.at_level("INFO", logger="llmpipe.engines.hf_engine"):
        hf_engine.generate(batch)
    t = hf_engine.last_batch
    assert (t.requests, t.prompt_width, t.steps) == (2, len(PROMPTS[3]), 4)  # 5 tokens: the first, then 4 steps
    assert t.first_s > 0 and t.decode_s > 0 and t.first_cpu_s >= 0 and t.decode_cpu_s >= 0
    assert f"transformers {t.describe()}" in caplog.messages


def test_per_request_limits_and_stop_ids(hf_engine):
    (ref,) = hf_engine.generate([EngineRequest("ref", PROMPTS[2], greedy(8))])
    stop = ref.token_ids[3]
    cut = ref.token_ids.index(stop) + 1
    out = hf_engine.generate([
        EngineRequest("short", PROMPTS[2], greedy(2)),
        EngineRequest("stop", PROMPTS[2], greedy(8, stop_token_ids=[stop])),
        EngineRequest("long", PROMPTS[1], greedy(6)),
    ])
    assert out[0].token_ids == ref.token_ids[:2] and out[0].finish_reason is FinishReason.LENGTH
    assert out[1].token_ids == ref.token_ids[:cut] and out[1].finish_reason is FinishReason.STOP
    assert len(out[2].token_ids) == 6


def test_on_tokens_growing_prefixes(hf_engine):
    seen: dict[str, list[list[int]]] = {}
    out = hf_engine.generate(
        [EngineRequest("a", PROMPTS[0], greedy(5)), EngineRequest("b", PROMPTS[3], greedy(3))],
        on_tokens=lambda rid, toks: seen.setdefault(rid, []).append(toks),
    )
    for o in out:
        calls = seen[o.request_id]
        assert [len(c) for c in calls] == list(range(1, len(o.token_ids) + 1))
        assert calls[-1] == o.token_ids


def test_seeded_sampling_reproducible_whatever_the_batch(hf_engine):
    p = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234)
    alone = hf_engine.generate([EngineRequest("s", PROMPTS[1], p)])[0].token_ids
    mixed = hf_engine.generate([
        EngineRequest("x", PROMPTS[3], SamplingParams(max_tokens=4, temperature=0.7)),
        EngineRequest("s", PROMPTS[1], p),
    ])[1].token_ids
    assert alone == mixed and len(alone) == 10


def test_eos_stops_unless_ignore_eos(tiny_model, tmp_path):
    from llmpipe.engines.hf_engine import TransformersEngine

    # A copy of the tiny model whose generation_config declares its first greedy token as EOS.
    plain = TransformersEngine(tiny_model, max_model_len=256)
    first = plain.generate([EngineRequest("a", PROMPTS[1], greedy(4))])[0].token_ids[0]
    plain.shutdown()
    model = tmp_path / "eos-model"
    shutil.copytree(tiny_model, model)
    gc = json.loads((model / "generation_config.json").read_text())
    gc["eos_token_id"] = [first]
    (model / "generation_config.json").write_text(json.dumps(gc))
    engine = TransformersEngine(str(model), max_model_len=256)
    assert first in engine.eos_token_ids
    stopped, ignored = engine.generate([
        EngineRequest("a", PROMPTS[1], greedy(4)),
        EngineRequest("b", PROMPTS[1], greedy(4, ignore_eos=True)),
    ])
    assert stopped.token_ids == [first] and stopped.finish_reason is FinishReason.STOP
    assert len(ignored.token_ids) == 4 and ignored.finish_reason is FinishReason.LENGTH
    engine.shutdown()


def test_invalid_prompts_raise_engine_error(hf_engine):
    with pytest.raises(EngineError):
        hf_engine.generate([EngineRequest("empty", [], greedy(2))])
    with pytest.raises(EngineError):
        hf_engine.generate([EngineRequest("long", [5] * hf_engine.max_model_len, greedy(2))])
    with pytest.raises(EngineError):
        hf_engine.generate([EngineRequest("oov", [10**7], greedy(2))])


def test_output_capped_by_max_model_len(hf_engine):
    n = hf_engine.max_model_len - 3
    (o,) = hf_engine.generate([EngineRequest("cap", [5] * n, greedy(10, ignore_eos=True))])
    assert len(o.token_ids) == 3 and o.finish_reason is FinishReason.LENGTH
