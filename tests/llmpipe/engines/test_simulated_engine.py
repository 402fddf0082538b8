from __future__ import annotations

import threading

import pytest

from llmpipe.engines.base import EngineRequest
from llmpipe.engines.simulated import SimulatedGpuCost, SimulatedGpuEngine
from llmpipe.messages import FinishReason, SamplingParams


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def sleep(self, s: float) -> None:
        assert s >= 0
        self.sleeps.append(s)
        self.now += s

    def clock(self) -> float:
        return self.now


def req(i: int, prompt_len: int = 512, max_tokens: int = 64, stop: list[int] | None = None) -> EngineRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, stop_token_ids=stop or [])
    return EngineRequest(f"r{i}", [10 + (j % 50) for j in range(prompt_len)], params)


def engine(cost: SimulatedGpuCost | None = None) -> tuple[SimulatedGpuEngine, FakeTime]:
    t = FakeTime()
    return SimulatedGpuEngine(cost, sleep=t.sleep, clock=t.clock), t


def run_time(batch: list[EngineRequest], cost: SimulatedGpuCost | None = None) -> float:
    e, t = engine(cost)
    start = t.now
    e.generate(batch)
    return t.now - start


def test_labelled_simulated_and_static():
    e, _ = engine()
    assert "simulated" in e.name
    assert e.continuous is False


def test_one_request_calibration():
    # One 512-token prompt with 64 output tokens: ~350 ms.
    assert run_time([req(0)]) == pytest.approx(0.0512 + 64 * 0.0046)
    assert 0.30 < run_time([req(0)]) < 0.40


def test_cost_grows_with_prompt_and_output():
    base = run_time([req(0, 512, 64)])
    assert run_time([req(0, 1024, 64)]) == pytest.approx(base + 512 * 0.0001)
    assert run_time([req(0, 512, 128)]) == pytest.approx(base + 64 * 0.0046)
    # Decode steps follow the longest request; a step gets dearer with the batch size.
    c = SimulatedGpuCost()
    two = run_time([req(0, 100, 10), req(1, 100, 50)])
    assert two == pytest.approx(200 * c.prefill_s_per_token + 50 * c.step_s(2))
    assert c.step_s(8) == pytest.approx(c.step_base_s + 7 * c.step_per_seq_s)


def test_batching_beats_serial():
    batch = [req(i) for i in range(32)]
    serial = 32 * run_time([req(0)])
    batched = run_time(batch)
    assert batched < serial / 4
    c = SimulatedGpuCost()
    assert c.theoretical_capacity_rps(512, 64, 32) > 4 * c.theoretical_capacity_rps(512, 64, 1)
    assert c.theoretical_capacity_rps(512, 64, 1) == pytest.approx(1 / run_time([req(0)]))


def test_large_batches_run_in_chunks():
    cost = SimulatedGpuCost(max_batch_size=4)
    e, t = engine(cost)
    batch = [req(i, 100, 10) for i in range(10)]
    out = e.generate(batch)
    assert [o.request_id for o in out] == [r.request_id for r in batch]
    expected = cost.chunk_s([100] * 4, [10] * 4) * 2 + cost.chunk_s([100] * 2, [10] * 2)
    assert t.now - 100.0 == pytest.approx(expected)
    assert cost.batch_s([100] * 10, [10] * 10) == pytest.approx(expected)
    assert e.stats()["batches"] == 3


def test_outputs_deterministic_and_stop_ids():
    e, _ = engine()
    r = EngineRequest("a", [7, 8, 9], SamplingParams(max_tokens=5))
    calls = []
    (o,) = e.generate([r], on_tokens=lambda rid, toks: calls.append((rid, toks)))
    assert o.token_ids == [7, 8, 9, 7, 8]
    assert o.finish_reason is FinishReason.LENGTH
    assert o.first_token_at is not None
    assert calls == [("a", [7, 8, 9, 7, 8])]
    assert e.generate([r])[0].token_ids == o.token_ids
    (s,) = e.generate([EngineRequest("b", [7, 8, 9], SamplingParams(max_tokens=5, stop_token_ids=[9]))])
    assert s.token_ids == [7, 8, 9]
    assert s.finish_reason is FinishReason.STOP


def test_the_continuous_engine_admits_waiting_requests_by_priority_then_arrival():
    from llmpipe.engines.simulated import SimulatedContinuousEngine, SimulatedGpuCost

    steps: list[list[str]] = []
    engine = SimulatedContinuousEngine(SimulatedGpuCost(max_batch_size=1),
                                       sleep=lambda s: steps.append([q.req.request_id for q in engine._running]))
    try:
        p = SamplingParams(max_tokens=2, ignore_eos=True)
        outs = engine.generate([EngineRequest("b1", [5, 6], p, priority=5), EngineRequest("b2", [5, 6], p, priority=5),
                                EngineRequest("i1", [5, 6], p, priority=0)])
    finally:
        engine.shutdown()
    assert [o.token_ids for o in outs] == [[5, 6]] * 3
    # one running at a time (max batch 1), two steps each: interactive first, batch in arrival order
    assert steps == [["i1"], ["i1"], ["b1"], ["b1"], ["b2"], ["b2"]]


def test_the_continuous_engine_prefills_in_chunks_within_the_step_token_budget():
    """vLLM v1's scheduler: running requests first (a decode is one token, an unfinished
    prompt takes what the budget leaves), then waiting ones while budget is left; a request
    emits its first token in the step that computes the last of its prompt."""
    from llmpipe.engines.simulated import SimulatedContinuousEngine

    t = FakeTime()
    cost = SimulatedGpuCost(max_batch_size=8, max_num_batched_tokens=1024)
    engine = SimulatedContinuousEngine(cost, sleep=t.sleep, clock=t.clock)
    try:
        outs = engine.generate([req(i, prompt_len=512, max_tokens=3) for i in range(4)])
    finally:
        engine.shutdown()
    assert [len(o.token_ids) for o in outs] == [3] * 4
    p, step = cost.prefill_s_per_token, cost.step_s
    assert t.sleeps == pytest.approx([
        1024 * p + step(2),  # r0, r1 whole prompts: budget spent
        1022 * p + step(4),  # r0, r1 decode; r2 whole, r3 510 of its 512
        2 * p + step(4),  # r0, r1 finish; r2 decodes; r3's last 2 prompt tokens (its first token)
        step(2),  # r2 finishes
        step(1),  # r3 finishes
    ])


def test_the_continuous_engine_streams_each_steps_tokens_as_vllm_does():
    """on_tokens after every step that made a token, from the first (its prompt's last chunk)
    on, with the tokens so far; the finished request's tokens come with generate's answer."""
    from llmpipe.engines.simulated import SimulatedContinuousEngine

    t = FakeTime()
    cost = SimulatedGpuCost(max_batch_size=8, max_num_batched_tokens=256)
    engine = SimulatedContinuousEngine(cost, sleep=t.sleep, clock=t.clock)
    heard: list[tuple[str, list[int], int]] = []  # (request, tokens, steps run by then)
    try:
        [out] = engine.generate([req(0, prompt_len=512, max_tokens=3)],
                                lambda rid, toks: heard.append((rid, toks, len(t.sleeps))))
    finally:
        engine.shutdown()
    # two prompt chunks of 256 (the first token in the second step), then a token a step
    assert [(rid, len(toks), steps) for rid, toks, steps in heard] == [("r0", 1, 2), ("r0", 2, 3), ("r0", 3, 4)]
    assert heard[1][1] == out.token_ids[:2] and heard[-1][1] == out.token_ids


def test_a_waiting_high_priority_request_does_not_preempt_a_full_running_set():
    """vLLM preempts only when the KV cache is short: an interactive request that arrives
    while every running slot is taken waits for one, then joins before older batch ones."""
    from llmpipe.engines.simulated import SimulatedContinuousEngine

    first_step, go = threading.Event(), threading.Event()
    steps: list[list[str]] = []

    def sleep(_s: float) -> None:
        steps.append([q.req.request_id for q in engine._running])
        first_step.set()
        go.wait(5)

    engine = SimulatedContinuousEngine(SimulatedGpuCost(max_batch_size=1), sleep=sleep)
    p = SamplingParams(max_tokens=2, ignore_eos=True)
    batch_out: list = []
    try:
        t = threading.Thread(target=lambda: batch_out.extend(engine.generate(
            [EngineRequest("b1", [5, 6], p, priority=10), EngineRequest("b2", [5, 6], p, priority=10)])))
        t.start()
        assert first_step.wait(5)  # b1 runs
        inter = threading.Thread(target=lambda: engine.generate([EngineRequest("i1", [5, 6], p, priority=0)]))
        inter.start()
        with engine._cond:
            assert engine._cond.wait_for(lambda: len(engine._waiting) == 2, timeout=5)
        go.set()
        t.join(5)
        inter.join(5)
    finally:
        go.set()
        engine.shutdown()
    assert [o.request_id for o in batch_out] == ["b1", "b2"]
    assert steps == [["b1"], ["b1"], ["i1"], ["i1"], ["b2"], ["b2"]]
