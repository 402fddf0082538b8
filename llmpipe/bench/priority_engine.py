"""The priority lanes inside the engine alone, in virtual time: no pipeline, no sleeps.

The SIMULATED continuous engine's scheduler (llmpipe/engines/simulated.py, vLLM v1's
priority scheduling with chunked prefill) is stepped on a virtual clock and fed a batch
backlog, delivered at ``batch_rate`` per second (the rate the CPU stages hand it on), and
interactive requests at ``interactive_rate``. The batch lane holds at most ``batch_slots``
requests in the engine (waiting + running), as the inference batcher holds the rest
(llmpipe/processors/batching.py). Deterministic, so it separates what the engine's scheduling costs an
interactive request from the machine's load:

    python -m llmpipe.bench.priority_engine
"""

from __future__ import annotations

from dataclasses import dataclass

from llmpipe.bench.stats import percentile
from llmpipe.engines.base import EngineRequest
from llmpipe.engines.simulated import SimulatedContinuousEngine, SimulatedGpuCost
from llmpipe.messages import SamplingParams

BATCH_PRIORITY = 10


@dataclass(frozen=True)
class EngineLoad:
    batch_jobs: int = 300
    batch_rate: float = 12.0
    interactive_rate: float = 1.0
    interactive_start_s: float = 1.0
    prompt_tokens: int = 512
    max_tokens: int = 64


@dataclass(frozen=True)
class EngineResult:
    interactive_p50_s: float  # arrival at the engine (or the batcher) to the last token
    batch_p50_s: float
    batch_done_s: float  # when the last batch request finished
    interactive_jobs: int
    batch_finished: int


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(load: EngineLoad, cost: SimulatedGpuCost, batch_slots: int) -> EngineResult:
    clock = _Clock()
    engine = SimulatedContinuousEngine(cost, start=False, clock=clock)
    params = SamplingParams(max_tokens=load.max_tokens, ignore_eos=True)
    prompt = [7] * load.prompt_tokens
    span = load.batch_jobs / load.batch_rate
    arrivals = [(i / load.batch_rate, f"b{i}", BATCH_PRIORITY) for i in range(load.batch_jobs)]
    n_inter = int(span * load.interactive_rate)
    arrivals += [(load.interactive_start_s + i / load.interactive_rate, f"i{i}", 0) for i in range(n_inter)]
    arrivals.sort()
    arrived = {rid: t for t, rid, _ in arrivals}
    held: list[str] = []  # batch requests the cap keeps out of the engine (in the batcher)
    seqs = []
    nxt = 0
    while nxt < len(arrivals) or held or engine._waiting or engine._running:
        while nxt < len(arrivals) and arrivals[nxt][0] <= clock.now:
            _, rid, prio = arrivals[nxt]
            nxt += 1
            if prio == BATCH_PRIORITY:
                held.append(rid)
            else:
                seqs.append(engine.enqueue(EngineRequest(rid, prompt, params, prio)))
        in_engine = sum(1 for s in engine._running if s.req.priority == BATCH_PRIORITY) + sum(
            1 for w in engine._waiting if w[0] == BATCH_PRIORITY)
        while held and in_engine < batch_slots:
            seqs.append(engine.enqueue(EngineRequest(held.pop(0), prompt, params, BATCH_PRIORITY)))
            in_engine += 1
        step = engine.schedule_step()
        if not step:
            clock.now = arrivals[nxt][0]
            continue
        clock.now += engine.step_cost_s(step)
        engine.apply_step(step, clock.now)
    inter = [s.finished - arrived[s.req.request_id] for s in seqs if s.req.priority != BATCH_PRIORITY]
    batch = [s.finished - arrived[s.req.request_id] for s in seqs if s.req.priority == BATCH_PRIORITY]
    return EngineResult(percentile(inter, 50), percentile(batch, 50),
                        max(s.finished for s in seqs if s.req.priority == BATCH_PRIORITY), len(inter), len(batch))


def main() -> None:
    cost = SimulatedGpuCost(max_batch_size=32)
    print(f"SIMULATED GPU, defaults (prefill {cost.prefill_s_per_token * 1000:g} ms/token, step "
          f"{cost.step_base_s * 1000:g} ms + {cost.step_per_seq_s * 1000:g} ms/extra sequence), max_num_seqs 32; "
          "300 batch requests of 512 + 64 tokens, interactive at 1/s; engine time only, virtual clock")
    print("| batch arrival (req/s) | prefill per step (tokens) | batch-lane slots | interactive p50 (s) | "
          "batch p50 (s) | backlog done (s) | batch throughput (req/s) |")
    print("|---|---|---|---|---|---|---|")
    for rate in (12.0, 100.0):
        for budget, label in ((2048, "2048 (vLLM)"), (10**9, "unbounded")):
            for slots in (32, 16):
                c = SimulatedGpuCost(max_batch_size=32, max_num_batched_tokens=budget)
                load = EngineLoad(batch_rate=rate)
                r = run(load, c, slots)
                print(f"| {rate:g} | {label} | {slots} | {r.interactive_p50_s:.2f} | {r.batch_p50_s:.2f} | "
                      f"{r.batch_done_s:.1f} | {load.batch_jobs / r.batch_done_s:.1f} |")


if __name__ == "__main__":
    main()
