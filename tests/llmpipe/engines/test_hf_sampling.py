"""The transformers engine's logits processing, with vLLM's semantics, on hand-made logits;
and what each engine declares it cannot do (a request asking it is refused, naming the field)."""

from __future__ import annotations

import pytest

from llmpipe.engines import hf_sampling
from llmpipe.engines.base import refusal
from llmpipe.engines.kinds import engine_class
from llmpipe.messages import SamplingParams, StructuredOutput

torch = pytest.importorskip("torch")


def _row(*values):
    return torch.tensor(values, dtype=torch.float32)


def _greedy(row, **kw):
    p = SamplingParams(temperature=0, **kw)
    return int(hf_sampling.process(torch, row.clone(), p, [], [], set()).argmax())


def test_allowed_token_ids_and_logit_bias():
    row = _row(5.0, 1.0, 0.0, -1.0)
    assert _greedy(row, allowed_token_ids=[2, 3]) == 2
    assert _greedy(row, logit_bias={3: 100.0}) == 3


def test_bad_words_forbid_the_last_token_after_their_prefix():
    p = SamplingParams(temperature=0, bad_words=["x"], bad_words_token_ids=[[0], [2, 1]])
    row = _row(9.0, 8.0, 1.0)
    assert int(hf_sampling.process(torch, row.clone(), p, [], [], set()).argmax()) == 1  # [0] is banned outright
    assert int(hf_sampling.process(torch, row.clone(), p, [], [2], set()).argmax()) == 2  # after 2, 1 is banned too


def test_min_tokens_holds_back_the_stop_ids():
    p = SamplingParams(temperature=0, min_tokens=2)
    row = _row(1.0, 9.0, 2.0)
    assert int(hf_sampling.process(torch, row.clone(), p, [], [5], {1}).argmax()) == 2
    assert int(hf_sampling.process(torch, row.clone(), p, [], [5, 5], {1}).argmax()) == 1


def test_penalties_as_vllm_defines_them():
    # repetition: a seen token's positive logit divided, a negative one multiplied (prompt and output)
    p = SamplingParams(temperature=0, repetition_penalty=2.0)
    got = hf_sampling.process(torch, _row(4.0, -1.0, 3.0), p, [0], [1], set())
    assert got.tolist() == [2.0, -2.0, 3.0]
    # frequency by count, presence once, over the output only
    p = SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=1.0)
    got = hf_sampling.process(torch, _row(4.0, 4.0, 4.0), p, [2], [0, 0, 1], set())
    assert got.tolist() == [4.0 - 1.0 - 1.0, 4.0 - 0.5 - 1.0, 4.0]


def test_top_k_and_min_p_cut_the_distribution():
    g = torch.Generator().manual_seed(0)
    row = _row(3.0, 2.9, 0.0, -5.0)
    assert {hf_sampling.draw(torch, row, SamplingParams(temperature=1.0, top_k=1), g) for _ in range(20)} == {0}
    drawn = {hf_sampling.draw(torch, row, SamplingParams(temperature=1.0, min_p=0.5), g) for _ in range(200)}
    assert drawn <= {0, 1} and drawn == {0, 1}


def test_each_engine_declares_what_it_cannot_do():
    hf, vllm, noop = (engine_class(k) for k in ("transformers", "vllm", "noop"))
    asks = SamplingParams(top_k=5, presence_penalty=0.5, bad_words=["x"])
    assert refusal(hf, asks) is None and refusal(vllm, asks) is None
    assert refusal(noop, asks)[0] == "bad_words"  # its tokens are made up: every sampling field is refused
    guided = SamplingParams(structured=StructuredOutput(regex="a"))
    field, message = refusal(hf, guided)
    assert field == "structured" and "transformers" in message
    assert refusal(vllm, guided) is None
