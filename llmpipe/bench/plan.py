"""What a run measures: engines, their modes, load points, request kinds and request counts (profiles)."""

from __future__ import annotations

from dataclasses import dataclass

from llmpipe.bench.kinds import JOBS, KINDS, endpoint
from llmpipe.bench.modes import ENDPOINTS, MODES, EngineSetup
from llmpipe.bench.prompts import count_tokens, make_prompts
from llmpipe.bench.runner import EnginePlan, Load
from llmpipe.engines.platform import Platform
from llmpipe.engines.vllm_batch_defaults import Device, this_device
from llmpipe.models.registry import context_length
from llmpipe.settings import EngineKind

ENGINES = ("noop", "simulated", "real")

# The default run: the study's point (512-token prompts, 64 output tokens, concurrency 64)
# on the simulated GPU; the orchestration's idle overhead and capacity on the no-op engine;
# real vLLM on SmolLM2 against `vllm serve`. "api": how the serial and pipeline modes are
# driven by default. The real engine is driven through the OpenAI endpoints, in all four
# request kinds (llmpipe/bench/kinds.py), as `vllm serve` is; noop and simulated use the job
# API (see docs/benchmarks.md for why). Real vLLM: the pipeline as shipped (`make up`:
# pipeline-window50) against `vllm serve` as typed (the targets) and against `vllm serve`
# with the pipeline's own engine arguments (the pipeline's overhead on the same engine).
PROFILES = {
    "noop": {"modes": ["celery-floor", "serial", "pipeline-window0", "pipeline-window50"], "concurrency": [1, 64],
             "prompt_tokens": 512, "max_tokens": 64, "api": "jobs", "kinds": ["completions-stream"]},
    "simulated": {"modes": ["serial", "pipeline-nobatch", "pipeline-window50"], "concurrency": [1, 16, 64],
                  "prompt_tokens": 512, "max_tokens": 64, "api": "jobs", "kinds": ["completions-stream"]},
    "real": {"modes": ["pipeline-window50", "vllm-serve", "vllm-serve-matched"], "concurrency": [1, 8, 32],
             "prompt_tokens": 128, "max_tokens": 32, "api": "openai", "kinds": list(KINDS)},
}
QUICK = {"concurrency": [2], "prompt_tokens": 32, "max_tokens": 8, "requests": 6}
QUICK_BY_ENGINE = {"noop": {"modes": ["celery-floor", "pipeline-window50"], "api": "jobs"},
                   "simulated": {"modes": ["serial", "pipeline-window50"], "api": "jobs"},
                   # The pipeline's four OpenAI request kinds, end to end (transformers on the tiny model).
                   "real": {"modes": ["pipeline-window50"], "api": "openai", "kinds": list(KINDS)}}
VLLM_ONLY = {"pipeline-continuous", "vllm-serve", "vllm-serve-matched"}
NOOP_ONLY = {"celery-floor"}  # the floor runs no engine: its figures are the no-op engine's reference


def default_requests(engine: str, mode: str, load: Load) -> tuple[int, float | None]:
    """(requests, seconds cap) per load point and request kind: enough for a steady state and
    no more; serial modes at concurrency 64 on the simulated GPU alone take most of a minute.
    Real engine, closed loop: 24 at c=1 and 2c + 16 above, so that after the first c (the
    initial burst) and the last c (the drain) 22 remain at c=1 and 16 above (c=8: 32, c=32:
    80). c=1 gets more: its TTFT ratio is the target that sits closest to its bound, and
    its requests are independent, so more of them narrow its interval (targets.py). With 10
    at c=1 the default real run took 460-550 s on 2 cores, several minutes of it the three
    servers' starts (vLLM compiles the model at each start); the 14 more requests of each
    kind and server at c=1, about 1 s each there, add about 3 minutes."""
    if load.rate is not None:
        return max(20, int(load.rate * 20)), None
    c = load.concurrency or 1
    if engine == "noop":
        return (60, None) if c == 1 else (12 * c, 12.0)
    if engine == "simulated":
        return ((4 * c + 16) if MODES[mode].batched else (c + 16 + c // 2)), None
    if not MODES[mode].batched:
        return max(10, 2 * c), None
    return (24 if c == 1 else 2 * c + 16), None


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
    kinds: list[str] | None = None  # OpenAI request kinds (default: per engine)
    # The real engine's pipeline starts Flower, as `llmpipe up` does (EngineSetup.flower).
    flower: bool = True


def _max_model_len(tokens: int, model_ctx: int | None) -> int:
    want = -(-(tokens + 64) // 256) * 256
    return min(want, model_ctx) if model_ctx else want


def _profile(o: Options, key: str) -> dict:
    prof = dict(PROFILES[key])
    if o.quick:
        prof.update(QUICK, **QUICK_BY_ENGINE[key])
    return prof


def _modes(o: Options, key: str, kind: EngineKind, prof: dict) -> tuple[list[str], list[str]]:
    """The modes this engine runs, and notes on those left out."""
    modes = [m for m in (o.modes or prof["modes"]) if m in prof["modes"] or o.modes]
    notes = []
    for cond, only, why in ((kind is not EngineKind.VLLM, VLLM_ONLY, f"vLLM only, skipped for the {kind.value} engine"),
                            (key != "noop", NOOP_ONLY, "no engine, run with the noop engine only")):
        dropped = [m for m in modes if cond and m in only]
        if dropped:
            modes = [m for m in modes if m not in dropped]
            notes.append(f"{', '.join(dropped)}: {why}")
    return modes, notes


def _kind_notes(plan: EnginePlan) -> list[str]:
    notes = []
    for m, _ in plan.points:
        skipped = [k for k in ([JOBS] if plan.api == JOBS else plan.kinds) if k not in plan.kinds_for(MODES[m])]
        if skipped and plan.kinds_for(MODES[m]):
            notes.append(f"{m}: {', '.join(skipped)} skipped (it answers {', '.join(ENDPOINTS[MODES[m].kind])} only)")
    return notes


def _setup(o: Options, key: str, kind: EngineKind, model_path: str, tokens: int) -> EngineSetup:
    label = {"noop": "noop (the engine does no work)",
             "simulated": "SIMULATED GPU (cost model; sleeps, no GPU)"}.get(key) or f"{kind.value} on {o.model} (CPU, real model)"
    # vLLM keeps the shipped max_model_len (unset: the model's own), as `vllm serve` picks it.
    mml = None if kind is EngineKind.VLLM else _max_model_len(tokens, context_length(model_path))
    return EngineSetup(key=key, kind=kind, label=label, model_path=model_path, max_model_len=mml, max_batch=o.max_batch,
                       cpu_workers=o.cpu_workers, sim=dict(o.sim) if key == "simulated" else {},
                       flower=o.flower and key == "real")


def _points(o: Options, key: str, modes: list[str], prof: dict) -> list[tuple[str, list[Load]]]:
    specs = [Load(rate=r) for r in o.rate] if o.rate else [Load(concurrency=c) for c in (o.concurrency or prof["concurrency"])]
    points = []
    for m in modes:
        loads = []
        for ld in specs:
            n, cap = default_requests(key, m, ld)
            n = o.requests or prof.get("requests") or n
            loads.append(Load(ld.concurrency, ld.rate, n, None if o.requests else cap))
        points.append((m, loads))
    return points


def interleaves(device: Device) -> bool:
    """The real engine's servers run at once, taking turns at each point (llmpipe/bench/runner.py),
    on a CPU: each holds its own model and KV cache in host memory, idle between its turns. On a
    GPU, each vLLM takes 0.9 of its memory, so they run one after another."""
    return device.platform is Platform.CPU


def build_plans(o: Options, model_path: str, tokenizer, console=None) -> list[EnginePlan]:
    plans = []
    for key in o.engines:
        prof = _profile(o, key)
        kind = {"noop": EngineKind.NOOP, "simulated": EngineKind.SIMULATED}.get(key) or EngineKind(o.real_engine)
        modes, notes = _modes(o, key, kind, prof)
        if not modes:
            continue
        pt = o.prompt_tokens or prof["prompt_tokens"]
        mt = o.max_tokens or prof["max_tokens"]
        api = o.api if o.api != "auto" else prof["api"]
        for k in o.kinds or ():
            endpoint(k)  # ValueError for an unknown kind
        plan = EnginePlan(_setup(o, key, kind, model_path, pt + mt), pt, mt, _points(o, key, modes, prof),
                          api=JOBS if api == JOBS else "openai", notes=notes,
                          kinds=[k for k in (o.kinds or prof["kinds"]) if k != JOBS],
                          interleave=key == "real" and interleaves(this_device()))
        plan.notes += _kind_notes(plan)
        need = max(sum(ld.requests for ld in loads) * len(plan.kinds_for(MODES[m])) for m, loads in plan.points) + 4
        plan.prompts = make_prompts(tokenizer, need, pt)
        sample = plan.prompts[: min(20, len(plan.prompts))]
        plan.measured_prompt_tokens = sum(count_tokens(tokenizer, p) for p in sample) / len(sample)
        plans.append(plan)
    return plans
