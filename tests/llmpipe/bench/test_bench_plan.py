"""What `llmpipe bench` runs by default on the real engine (llmpipe/bench/plan.py): the
shipped pipeline against both `vllm serve` modes, at concurrency 1, 8 and 32, in all four
request kinds, with the model's own max_model_len."""

from __future__ import annotations

from llmpipe.bench.kinds import JOBS, KINDS
from llmpipe.bench.modes import MODES
from llmpipe.bench.plan import Options, build_plans
from tests.harness.tokenizers import WordTokenizer


def _options(**kw) -> Options:
    base = dict(engines=["real"], modes=None, concurrency=None, rate=None, requests=None, prompt_tokens=None,
                max_tokens=None, model="smollm2", real_engine="vllm", max_batch=32, cpu_workers=2, sim={})
    return Options(**{**base, **kw})


def test_the_default_real_run():
    (plan,) = build_plans(_options(), "/models/smollm2", WordTokenizer())
    assert [m for m, _ in plan.points] == ["pipeline-window50", "vllm-serve", "vllm-serve-matched"]
    assert MODES["pipeline-window50"].window_ms == 50  # the shipped batch_window_ms
    for _, loads in plan.points:
        assert [(ld.concurrency, ld.requests) for ld in loads] == [(1, 24), (8, 32), (32, 80)]
    assert plan.api == "openai" and plan.kinds == list(KINDS)
    assert all(plan.kinds_for(MODES[m]) == list(KINDS) for m, _ in plan.points)
    assert (plan.prompt_tokens, plan.max_tokens) == (128, 32)
    assert plan.setup.max_model_len is None  # as shipped, and as `vllm serve` picks it
    # Fresh prompts for every point a server takes, in every kind.
    assert len(set(plan.prompts)) >= 4 * (24 + 32 + 80)


def test_the_real_engines_pipeline_runs_flower_as_llmpipe_up_does():
    plans = build_plans(_options(engines=["noop", "simulated", "real"]), "/models/smollm2", WordTokenizer())
    assert {p.setup.key: p.setup.flower for p in plans} == {"noop": False, "simulated": False, "real": True}
    # The GPU run (benchmarks/gpu/run.py) carries no Flower to its machine.
    (plan,) = build_plans(_options(flower=False), "/models/smollm2", WordTokenizer())
    assert plan.setup.flower is False


def test_kinds_and_modes_can_be_narrowed():
    (plan,) = build_plans(_options(modes=["pipeline-continuous", "vllm-serve", "serial"], kinds=["chat-stream", "completions"],
                                   concurrency=[4], requests=5), "/models/smollm2", WordTokenizer())
    assert [m for m, _ in plan.points] == ["pipeline-continuous", "vllm-serve", "serial"]
    assert plan.kinds_for(MODES["serial"]) == ["completions"]
    assert any("serial: chat-stream skipped" in n for n in plan.notes)
    assert [ld.requests for _, loads in plan.points for ld in loads] == [5, 5, 5]


def test_the_quick_profile_takes_the_four_kinds_through_the_pipeline():
    (plan,) = build_plans(_options(real_engine="transformers", quick=True), "/models/tiny", WordTokenizer())
    assert [m for m, _ in plan.points] == ["pipeline-window50"]
    assert plan.kinds_for(MODES["pipeline-window50"]) == list(KINDS)
    jobs = build_plans(_options(real_engine="transformers", quick=True, api="jobs"), "/models/tiny", WordTokenizer())
    assert jobs[0].kinds_for(MODES["pipeline-window50"]) == [JOBS]


def test_vllm_only_modes_leave_the_transformers_engine():
    (plan,) = build_plans(_options(real_engine="transformers"), "/models/smollm2", WordTokenizer())
    assert [m for m, _ in plan.points] == ["pipeline-window50"]
    assert any("vllm-serve, vllm-serve-matched: vLLM only" in n for n in plan.notes)
