"""The engine-only lanes study (llmpipe/bench/priority_engine.py): virtual time, so these
are facts of the scheduling, not speeds of this machine."""

from llmpipe.bench.priority_engine import EngineLoad, run
from llmpipe.engines.simulated import SimulatedGpuCost


def test_with_the_engine_saturated_a_reserved_slot_share_shortens_the_interactive_requests_and_starves_no_batch_job():
    load = EngineLoad(batch_jobs=120, batch_rate=100.0)
    cost = SimulatedGpuCost(max_batch_size=32)
    shared = run(load, cost, batch_slots=32)  # no reservation: every running slot may be batch
    reserved = run(load, cost, batch_slots=16)
    assert shared.batch_finished == reserved.batch_finished == 120
    assert shared.interactive_jobs == reserved.interactive_jobs > 0
    assert reserved.interactive_p50_s < shared.interactive_p50_s
    # the price: the batch backlog drains later
    assert reserved.batch_done_s > shared.batch_done_s


def test_a_step_token_budget_spreads_the_joiners_prefill_and_an_unbounded_one_charges_it_to_one_step():
    load = EngineLoad(batch_jobs=120, batch_rate=100.0)
    chunked = run(load, SimulatedGpuCost(max_batch_size=32, max_num_batched_tokens=2048), batch_slots=32)
    whole = run(load, SimulatedGpuCost(max_batch_size=32, max_num_batched_tokens=10**9), batch_slots=32)
    assert chunked.interactive_p50_s < whole.interactive_p50_s
