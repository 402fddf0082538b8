"""``llmpipe bench``: every serving mode on the same prompts, side by side, in one run."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import click
from click.core import ParameterSource
from rich.console import Console

from llmpipe.bench.kinds import KINDS
from llmpipe.bench.machine import loadavg, run_meta
from llmpipe.bench.modes import MODES
from llmpipe.bench.plan import ENGINES, Options, build_plans
from llmpipe.bench.plots import missing
from llmpipe.bench.report import write_all
from llmpipe.bench.runner import EnginePlan, RunConfig, run_plans
from llmpipe.bench.targets import evaluate
from llmpipe.engines.simulated import SimulatedGpuCost
from llmpipe.local.redis_server import EmbeddedRedis
from llmpipe.models.registry import resolve_model
from llmpipe.settings import Settings


def _csv(kind):
    def parse(ctx, param, value):
        if value is None:
            return None
        try:
            return [kind(v) for v in str(value).split(",") if v.strip()]
        except ValueError as e:
            raise click.BadParameter(str(e)) from e
    return parse


def _kind(value: str) -> str:
    if value not in KINDS:
        raise ValueError(f"unknown request kind {value!r}; choose from {', '.join(KINDS)}")
    return value


@click.command()
@click.option("--engine", "engines", default="all", show_default=True,
              help="real, simulated, noop, or all (comma-separated list allowed).")
@click.option("--modes", callback=_csv(str), help=f"Comma-separated subset of: {', '.join(MODES)} (default: per "
              "engine); or scaling, alone; or priority, alone (lanes: a batch backlog, interactive at 1 req/s); or "
              "multiworker, alone (prefix-aware routing against the shared queue, and failover; "
              "python -m llmpipe.bench.multiworker --help for its own options); or batch, alone (the Batch API "
              "against vllm run_batch, interactive TTFT under a draining batch, crashes; --requests lines; "
              "python -m llmpipe.bench.batch --help for its own options).")
@click.option("--concurrency", callback=_csv(int), help="Closed loop: comma-separated client counts (default: per engine).")
@click.option("--rate", callback=_csv(float), help="Open loop instead: comma-separated Poisson arrival rates (req/s).")
@click.option("--requests", type=int, help="Requests per load point and request kind (default: per engine and mode).")
@click.option("--duration", type=float, help="Seconds per load point instead of a request count.")
@click.option("--prompt-tokens", type=int, help="Prompt length in tokens (default 512; 128 for the real engine).")
@click.option("--max-tokens", type=int, help="Output tokens per request (default 64; 32 for the real engine).")
@click.option("--model", default=None,
              help="Model for every engine's tokenizer and the real engine (default smollm2; tiny with --quick).")
@click.option("--real-engine", type=click.Choice(["vllm", "transformers"]), default=None,
              help="The real engine (default vllm; transformers with --quick).")
@click.option("--max-batch-size", type=int, help="Max batch (default 32; 8 for the scaling mode).")
@click.option("--cpu-workers", type=int, default=2, show_default=True, help="Processes per CPU stage pool.")
@click.option("--sim-preprocess-ms", type=float, default=20.0, show_default=True,
              help="Simulated engine: CPU burn per request in preprocess.")
@click.option("--sim-postprocess-ms", type=float, default=15.0, show_default=True,
              help="Simulated engine: CPU burn per request in postprocess.")
@click.option("--sim-prefill-ms-per-token", type=float, default=None, help="Simulated GPU cost model (default from Settings).")
@click.option("--sim-step-ms", type=float, default=None, help="Simulated GPU: decode step of a batch of one.")
@click.option("--sim-step-ms-per-seq", type=float, default=None, help="Simulated GPU: added per extra sequence.")
@click.option("--api", type=click.Choice(["auto", "jobs", "openai"]), default="auto", show_default=True,
              help="Client protocol for the serial and pipeline modes: the job API, or the OpenAI endpoints in the "
                   "--kinds. auto: openai for the real engine, jobs for noop and simulated.")
@click.option("--kinds", callback=_csv(_kind), help=f"OpenAI request kinds, comma-separated subset of: {', '.join(KINDS)} "
              "(default: all four for the real engine; completions-stream elsewhere).")
@click.option("--request-timeout", type=float, default=None,
              help="Seconds before a request counts as failed (default 300; 60 with --quick).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("bench-results"), show_default=True)
@click.option("--quick", is_flag=True, help="Smoke profile: tiny model, transformers, a handful of requests.")
@click.option("--workers", callback=_csv(int), help="Scaling mode: inference worker counts (default 1,2,4).")
@click.option("--hop-rtt-ms", type=float, help="Scaling mode: added round trip between two hosts (default 20).")
@click.option("--cpu-instances", type=int, help="Scaling mode: Celery workers per CPU stage (default 4).")
@click.option("--sim-continuous", is_flag=True, help="Priority mode: the SIMULATED GPU schedules step by step by "
              "priority, as vLLM does (continuous batching).")
@click.option("--lanes-off", is_flag=True, help="Priority mode: the control, the interactive requests in the batch lane too.")
@click.pass_context
def bench(ctx, **kw):
    """Benchmark the pipeline against `vllm serve` (as typed, and on the pipeline's engine
    arguments) on real vLLM, and serial against the pipeline on a SIMULATED GPU and a no-op
    engine; writes report.md, results.json and plots to --out. `--modes scaling` instead
    runs 1, 2 and 4 inference workers on hosts of their own with 20 ms round trips between
    hosts (network namespaces; needs root)."""
    a = SimpleNamespace(**kw)
    console = Console(stderr=True, highlight=False)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    why = missing()
    if why:
        console.print(f"[yellow]{why}[/]")
    for alone in ("scaling", "priority", "multiworker", "batch"):
        if a.modes and alone in a.modes and (a.modes != [alone] or a.rate):
            raise click.BadParameter(f"{alone} runs alone (no other mode, no --rate)", param_hint="--modes")
    if a.modes == ["scaling"]:
        from llmpipe.bench.scaling import bench_scaling

        given = {k: v for k, v in ctx.params.items() if ctx.get_parameter_source(k) is not ParameterSource.DEFAULT}
        renames = {"sim_preprocess_ms": "sim_preprocess_cpu_ms", "sim_postprocess_ms": "sim_postprocess_cpu_ms"}
        sys.exit(bench_scaling({renames.get(k, k): v for k, v in given.items()}, console))
    if a.modes == ["priority"]:
        sys.exit(_priority(a, console))
    if a.modes == ["multiworker"]:
        from llmpipe.bench.multiworker import MultiOptions, quick, run_multiworker

        o = MultiOptions(model=a.model or "smollm2", workers=(a.workers or [2])[0], requests=a.requests or 240,
                         concurrency=(a.concurrency or [16])[0], max_tokens=a.max_tokens or 32)
        sys.exit(run_multiworker(quick(o) if a.quick else o, a.out / "multiworker", console))
    if a.modes == ["batch"]:
        sys.exit(_batch(a, console))
    sys.exit(_run(a, console))


def _batch(a: SimpleNamespace, console: Console) -> int:
    """The Batch API's figures (llmpipe/bench/batch.py); 1 when a target is missed."""
    from llmpipe.bench.batch import BatchBenchOptions, bench_batch, met

    o = BatchBenchOptions(model=a.model or "smollm2", lines=a.requests or 2000, max_tokens=a.max_tokens or 64,
                          prompt_tokens=a.prompt_tokens or 128)
    res = bench_batch(o, a.out / "batch", console)
    console.print((a.out / "batch" / "batch.md").read_text(), markup=False, highlight=False)
    return 0 if met(res) else 1


def _sim(a: SimpleNamespace) -> dict:
    d = Settings()
    pick = lambda given, default: default if given is None else given  # noqa: E731
    return {"sim_prefill_ms_per_token": pick(a.sim_prefill_ms_per_token, d.sim_prefill_ms_per_token),
            "sim_step_ms": pick(a.sim_step_ms, d.sim_step_ms),
            "sim_step_ms_per_seq": pick(a.sim_step_ms_per_seq, d.sim_step_ms_per_seq),
            "sim_preprocess_cpu_ms": a.sim_preprocess_ms, "sim_postprocess_cpu_ms": a.sim_postprocess_ms}


def _priority(a: SimpleNamespace, console: Console) -> int:
    from transformers import AutoTokenizer

    from llmpipe.bench.priority import PriorityOptions, bench_priority

    sim = {**_sim(a), "sim_continuous": a.sim_continuous}
    model_path = resolve_model(a.model or ("tiny" if a.quick else "smollm2"), Settings().models_dir, progress=False)
    po = PriorityOptions(batch_jobs=a.requests or (30 if a.quick else 300), prompt_tokens=a.prompt_tokens or 512,
                         max_tokens=a.max_tokens or 64, max_interactive=10 if a.quick else 200, control=a.lanes_off)
    return bench_priority(model_path, AutoTokenizer.from_pretrained(model_path), sim, a.out, console,
                          max_batch=a.max_batch_size or 32, cpu_workers=a.cpu_workers, o=po)


def _plans(a: SimpleNamespace, console: Console) -> tuple[list[EnginePlan], str]:
    from transformers import AutoTokenizer

    chosen = list(ENGINES) if a.engines == "all" else [e.strip() for e in a.engines.split(",")]
    bad = [e for e in chosen if e not in ENGINES]
    if bad:
        raise click.BadParameter(f"unknown engine(s) {bad}; choose from {ENGINES} or all", param_hint="--engine")
    bad = [m for m in a.modes or [] if m not in MODES]
    if bad:
        raise click.BadParameter(f"unknown mode(s) {bad}", param_hint="--modes")
    model = a.model or ("tiny" if a.quick else "smollm2")
    with console.status(f"preparing model {model}"):
        model_path = resolve_model(model, Settings().models_dir, progress=False)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    o = Options(engines=chosen, modes=a.modes, concurrency=a.concurrency, rate=a.rate, requests=a.requests,
                prompt_tokens=a.prompt_tokens, max_tokens=a.max_tokens, model=model,
                real_engine=a.real_engine or ("transformers" if a.quick else "vllm"), max_batch=a.max_batch_size or 32,
                cpu_workers=a.cpu_workers, sim=_sim(a), api=a.api, quick=a.quick, kinds=a.kinds)
    plans = build_plans(o, model_path, tokenizer)
    for p in plans:
        console.print(f"[bold]{p.setup.label}[/]: " + "; ".join(
            f"{m} ({', '.join(p.kinds_for(MODES[m]))}) "
            + ", ".join(f"{ld.label}x" + (f"{a.duration:g}s" if a.duration else str(ld.requests)) for ld in loads)
            for m, loads in p.points))
    return plans, model


def _run(a: SimpleNamespace, console: Console) -> int:
    a.out.mkdir(parents=True, exist_ok=True)
    meta = run_meta()
    t0 = time.monotonic()
    plans, model = _plans(a, console)
    redis_srv = EmbeddedRedis(a.out / "redis", appendonly=False).start()
    try:
        cfg = RunConfig(out=a.out, duration_s=a.duration, request_timeout_s=a.request_timeout or (60.0 if a.quick else 300.0))
        rows = run_plans(plans, cfg, redis_srv.url, console)
    finally:
        redis_srv.stop()
    theoretical: dict[str, float] = {}
    plan_meta = [_plan_meta(p, model, theoretical) for p in plans]
    meta.update(duration_s=time.monotonic() - t0, loadavg_end=loadavg())
    meta["profile"] = "quick (smoke: tiny model, a handful of requests; targets not evaluated)" if a.quick else "default"
    result = {"meta": meta, "plans": plan_meta, "theoretical_capacity_rps": theoretical,
              "modes": {k: m.about for k, m in MODES.items()}, "rows": rows,
              "targets": [] if a.quick else evaluate(rows, theoretical)}
    files = write_all(result, a.out)
    for t in result["targets"]:
        mark = "[green]met[/]" if t["met"] else "[red]missed[/]"
        v = "n/a" if t["value"] is None else f"{t['value']:.2f}"
        if t.get("ci"):
            v += f" (95% CI {t['ci'][0]:.2f}-{t['ci'][1]:.2f}{', within noise' if t['noise'] else ''})"
        console.print(f"{mark} {t['name']}: {v} (want {t['target']}; {t['detail']})")
    plots = f"{len(files) - 2} plots" if not result.get("plots") else "no plots (matplotlib is missing)"
    console.print(f"wrote {files['markdown']}, {files['json']} and {plots} in {meta['duration_s']:.0f} s")
    return 1 if any("summary" not in r for r in rows) else 0


def _plan_meta(p: EnginePlan, model: str, theoretical: dict[str, float]) -> dict:
    """The plan as results.json and report.md describe it; the simulated engine's
    theoretical capacity per load goes into ``theoretical``."""
    s = p.setup
    driven = (f"the OpenAI endpoints ({', '.join(p.kinds)})" if p.api == "openai" else "the job API")
    mml = "unset (the model's own, as shipped)" if s.max_model_len is None else str(s.max_model_len)
    text = (f"Model {model} ({s.model_path}); prompts ~{p.measured_prompt_tokens:.0f} tokens (measured; chat adds the "
            f"model's chat template), max_tokens {p.max_tokens} with ignore_eos; serial/pipeline driven through {driven}; "
            f"max batch {s.max_batch}; CPU pools {s.cpu_workers} processes each; max_model_len {mml}.")
    if s.key == "simulated":
        cost = SimulatedGpuCost(s.sim["sim_prefill_ms_per_token"] / 1000, s.sim["sim_step_ms"] / 1000,
                                s.sim["sim_step_ms_per_seq"] / 1000, s.max_batch)
        one = cost.batch_s([round(p.measured_prompt_tokens)], [p.max_tokens])
        for _m, loads in p.points:
            for ld in loads:
                b = min(s.max_batch, ld.concurrency or s.max_batch)
                theoretical[ld.label] = cost.theoretical_capacity_rps(round(p.measured_prompt_tokens), p.max_tokens, b)
        text += (f" SIMULATED GPU cost: prefill {s.sim['sim_prefill_ms_per_token']} ms/token, decode step "
                 f"{s.sim['sim_step_ms']} ms + {s.sim['sim_step_ms_per_seq']} ms per extra sequence; one request = "
                 f"{one * 1000:.0f} ms of simulated GPU time; theoretical capacity (full batches back to back): "
                 + ", ".join(f"{k}: {v:.2f} req/s" for k, v in theoretical.items())
                 + f". Simulated CPU burn: {s.sim['sim_preprocess_cpu_ms']:g} ms preprocess, "
                 f"{s.sim['sim_postprocess_cpu_ms']:g} ms postprocess (CPU time, per request).")
    return {"engine": s.key, "label": s.label, "kind": s.kind.value, "model": model, "model_path": s.model_path,
            "prompt_tokens": p.measured_prompt_tokens, "max_tokens": p.max_tokens, "api": p.api, "kinds": p.kinds,
            "max_batch": s.max_batch, "cpu_workers": s.cpu_workers, "sim": s.sim,
            "points": [[m, [ld.label for ld in loads]] for m, loads in p.points], "notes": p.notes, "settings_text": text}
