"""What a run measures: engines, their modes, load points and request counts (profiles)."""

from __future__ import annotations

from dataclasses import dataclass

from llmpipe.bench.modes import MODES, EngineSetup, has_completions_endpoint
from llmpipe.bench.runner import EnginePlan, Load
from llmpipe.settings import EngineKind

ENGINES = ("noop", "simulated", "real")

# The default run (~10 min on 2 cores): the study's point (512-token prompts, 64 output
# tokens, concurrency 64) on the simulated GPU; the orchestration's idle overhead and
# capacity on the no-op engine; real vLLM, smaller (2 CPU cores), against `vllm serve`.
# "api": how the serial and pipeline modes are driven by default. The real engine uses the
# OpenAI streaming endpoint, as `vllm serve` is driven, with TTFT; noop and simulated use
# the job API (see docs/benchmarks.md for why).
PROFILES = {
    "noop": {"modes": ["celery-floor", "serial", "pipeline-window0", "pipeline-window50"], "concurrency": [1, 64],
             "prompt_tokens": 512, "max_tokens": 64, "api": "jobs"},
    "simulated": {"modes": ["serial", "pipeline-nobatch", "pipeline-window50"], "concurrency": [1, 16, 64],
                  "prompt_tokens": 512, "max_tokens": 64, "api": "jobs"},
    "real": {"modes": ["serial", "pipeline-nobatch", "pipeline-window50", "pipeline-continuous", "vllm-serve"],
             "concurrency": [8], "prompt_tokens": 128, "max_tokens": 32, "api": "openai"},
}
QUICK = {"modes": ["serial", "pipeline-window50"], "concurrency": [2], "prompt_tokens": 32, "max_tokens": 8,
         "requests": 6, "api": "jobs"}
QUICK_MODES = {"noop": ["celery-floor", "pipeline-window50"], "simulated": ["serial", "pipeline-window50"], "real": ["pipeline-window50"]}
VLLM_ONLY = {"pipeline-continuous", "vllm-serve"}
NOOP_ONLY = {"celery-floor"}  # the floor runs no engine: its figures are the no-op engine's reference


def default_requests(engine: str, mode: str, load: Load) -> tuple[int, float | None]:
    """(requests, seconds cap): enough for a steady state and no more; serial modes at
    concurrency 64 on the simulated GPU alone take most of a minute."""
    if load.rate is not None:
        return max(20, int(load.rate * 20)), None
    c = load.concurrency or 1
    if engine == "noop":
        return (60, None) if c == 1 else (12 * c, 12.0)
    if engine == "simulated":
        return ((4 * c + 16) if MODES[mode].batched else (c + 16 + c // 2)), None
    return (4 * c if MODES[mode].batched else 2 * c), None


@dataclass
class Options:
    engines: list[str]
    modes: list[str] | None
    concurrency: list[int] | None
    rate: list[float] | None
    requests: int | None
    prompt_tokens: int | None
    max_tokens: int | None
    model: str
    real_engine: str
    max_batch: int
    cpu_workers: int
    sim: dict
    api: str = "auto"
    quick: bool = False


def _max_model_len(tokens: int, model_ctx: int | None) -> int:
    want = -(-(tokens + 64) // 256) * 256
    return min(want, model_ctx) if model_ctx else want


def build_plans(o: Options, model_path: str, tokenizer, console=None) -> list[EnginePlan]:
    from llmpipe.bench.prompts import count_tokens, make_prompts
    from llmpipe.models.registry import context_length

    plans = []
    ctx = context_length(model_path)
    for key in o.engines:
        prof = dict(PROFILES[key], **(dict(QUICK, modes=QUICK_MODES[key]) if o.quick else {}))
        kind = {"noop": EngineKind.NOOP, "simulated": EngineKind.SIMULATED}.get(key) or EngineKind(o.real_engine)
        modes = [m for m in (o.modes or prof["modes"]) if m in prof["modes"] or o.modes]
        notes = []
        if kind is not EngineKind.VLLM:
            dropped = [m for m in modes if m in VLLM_ONLY]
            modes = [m for m in modes if m not in VLLM_ONLY]
            if dropped:
                notes.append(f"{', '.join(dropped)}: vLLM only, skipped for the {kind.value} engine")
        if key != "noop":
            dropped = [m for m in modes if m in NOOP_ONLY]
            modes = [m for m in modes if m not in NOOP_ONLY]
            if dropped:
                notes.append(f"{', '.join(dropped)}: no engine, run with the noop engine only")
        if not modes:
            continue
        pt = o.prompt_tokens or prof["prompt_tokens"]
        mt = o.max_tokens or prof["max_tokens"]
        label = {"noop": "noop (the engine does no work)",
                 "simulated": "SIMULATED GPU (cost model; sleeps, no GPU)"}.get(key) or f"{kind.value} on {o.model} (CPU, real model)"
        setup = EngineSetup(key=key, kind=kind, label=label, model_path=model_path,
                            max_model_len=_max_model_len(pt + mt, ctx), max_batch=o.max_batch, cpu_workers=o.cpu_workers,
                            sim=dict(o.sim) if key == "simulated" else {})
        loads_spec = ([Load(rate=r) for r in o.rate] if o.rate else
                      [Load(concurrency=c) for c in (o.concurrency or prof["concurrency"])])
        points = []
        for m in modes:
            loads = []
            for ld in loads_spec:
                n, cap = default_requests(key, m, ld)
                n = o.requests or prof.get("requests") or n
                loads.append(Load(ld.concurrency, ld.rate, n, None if o.requests else cap))
            points.append((m, loads))
        need = max(sum(ld.requests for ld in loads) for _, loads in points) + 4
        api = o.api if o.api != "auto" else prof["api"]
        if api == "openai" and o.api == "auto" and not has_completions_endpoint():
            api = "jobs"
        plan = EnginePlan(setup, pt, mt, points, api=api, notes=notes)
        plan.prompts = make_prompts(tokenizer, need, pt)
        sample = plan.prompts[: min(20, len(plan.prompts))]
        plan.measured_prompt_tokens = sum(count_tokens(tokenizer, p) for p in sample) / len(sample)
        plans.append(plan)
    return plans
