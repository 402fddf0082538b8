"""What ``llmpipe bench --modes scaling`` runs, in order, and which prompts each point sends:
ones no earlier point sent, so that prefix-aware routing's memory of where a prompt went
(at two workers) does not steer the point at four."""

from __future__ import annotations

import pytest

from llmpipe.bench.scaling import QUICK, WARMUP_PROMPTS, _options, plan, prompts_needed
from tests.harness.tokenizers import WordTokenizer


def _quick(**given):
    return _options(given, True, "/models/tiny", WordTokenizer())


def test_the_quick_plan_takes_one_worker_then_two_then_four_and_the_one_host_layout_last():
    o = _quick()
    assert plan(o) == [("hosts-20ms", [(1, 8, False), (1, 1, True), (2, 8, False), (4, 8, False)]),
                       ("one-host", [(1, 1, True)])]
    assert prompts_needed(o) == 3 * QUICK["requests"] + 2 * QUICK["network_requests"] + WARMUP_PROMPTS
    assert len(o.prompts) == prompts_needed(o)


def test_every_point_sends_prompts_no_other_point_and_no_warm_up_sent():
    o = _quick()
    sent = [o.take_prompts(o.n_requests(c, network)) for _, points in plan(o) for _, c, network in points]
    assert [len(p) for p in sent] == [QUICK["requests"], QUICK["network_requests"], QUICK["requests"],
                                      QUICK["requests"], QUICK["network_requests"]]
    flat = [p for point in sent for p in point]
    assert len(set(flat)) == len(flat)
    assert not set(flat) & set(o.prompts[-WARMUP_PROMPTS:])
    with pytest.raises(ValueError, match="1 more prompts wanted, 0 unsent"):
        o.take_prompts(1)


def test_a_timed_point_takes_every_prompt_the_unsent_first():
    o = _quick()
    first = o.take_prompts(3)
    timed = o.take_prompts(0)
    assert timed[:-3] == o.prompts[3:] and timed[-3:] == first
