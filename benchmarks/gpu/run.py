"""The design study's table on a GPU: the benchmark's serial, pipeline-nobatch and
pipeline-window50 modes with the transformers engine on a random-weight Llama built on
the device, 512-token prompts and 64 output tokens at c=16 and c=64, GPU utilization and
memory sampled every 0.5 s. benchmarks/gpu/run.sh installs the carried wheels and runs this.

    python -m benchmarks.gpu.run --out DIR [--shape 13b|1b|tiny] [--device cuda|cpu] [--quick]
                                 [--modes pipeline-window50] [--concurrency 16,64]

It fits a time budget (``--budget-s``, from its own start): after measuring one batch of 32
against 32 single requests, it sizes each load point's request count from those times.
With ``--device cpu`` it is the CPU rehearsal, and every output says so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

MODES = ["serial", "pipeline-nobatch", "pipeline-window50"]
BATCHED = {"pipeline-window50"}
FULL = {"concurrency": [16, 64], "prompt_tokens": 512, "max_tokens": 64}
QUICK = {"concurrency": [2, 4], "prompt_tokens": 64, "max_tokens": 8}
MAX_BATCH = 32
OUT_FILES = ("report.md", "results.json", "latency_cdf_real.png", "scaling_real.png", "gpu_util.png", "run.log",
             "engine-batches.log")


def size_points(concurrency: list[int], single_s: float, batch_s: float, budget_s: float,
                startup_s: float, quick: bool = False,
                modes: list[str] | None = None) -> tuple[dict[tuple[str, int], int], float, list[str]]:
    """Requests per (mode, concurrency) to fit ``budget_s``; the estimated seconds; the
    points left out because even their smallest sizes would not fit.

    A closed loop at concurrency c needs its first c requests (the burst) and enough after
    them for a steady window. Unbatched modes serve one request per ``single_s``; the
    batched mode serves a batch of up to 32 per ``batch_s``. When the budget is short, the
    unbatched modes get fewer steady requests first, then pipeline-nobatch is left out at
    the highest concurrency, then at the next (serial against the window stays)."""
    nb_extra = 4 if quick else 16
    counts = {}
    for c in concurrency:
        for m in modes or MODES:
            counts[(m, c)] = (3 if quick else 4) * c if m in BATCHED else c + nb_extra

    def estimate() -> float:
        t = startup_s * len({m for m, _ in counts})
        for (m, c), n in counts.items():
            t += (n / min(c, MAX_BATCH)) * batch_s if m in BATCHED else n * single_s
        return t

    while estimate() > budget_s and nb_extra > (4 if quick else 8):
        nb_extra -= 4
        for (m, c) in counts:
            if m not in BATCHED:
                counts[(m, c)] = c + nb_extra
    dropped = []
    for c in sorted(concurrency, reverse=True):
        if quick or estimate() <= budget_s:  # the rehearsal runs every mode: that is its point
            break
        if ("pipeline-nobatch", c) not in counts:
            continue
        del counts[("pipeline-nobatch", c)]
        dropped.append(f"pipeline-nobatch c={c}")
    return counts, estimate(), dropped


def _log(msg: str) -> None:
    print(f"[gpu-run {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _batch_check(model: str, prof: dict, out: Path, max_singles_s: float, timeout_s: float) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.gpu.batch_check", "--model", model, "--out", str(out),
           "--prompt-tokens", str(prof["prompt_tokens"]), "--max-tokens", str(prof["max_tokens"]),
           "--batch", str(MAX_BATCH), "--max-singles-s", str(max_singles_s)]
    subprocess.run(cmd, check=True, timeout=timeout_s)  # its own process: its GPU memory is freed after
    return json.loads(out.read_text())


def _log_tails(work: Path, lines: int = 40) -> str:
    """The end of every server log of the run, for a run that cannot be repeated at will."""
    parts = []
    for f in sorted((work / "bench" / "logs").rglob("*.log")):
        tail = f.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"==> {f.relative_to(work)} <==\n" + "\n".join(tail))
    return "\n\n".join(parts) + "\n"


def _engine_batches(work: Path) -> str:
    """Every batch line the engines logged (llmpipe/engines/batch_timing.py), per server log:
    a slow batch shows whether its time was the engine thread's CPU or a wait."""
    from llmpipe.engines.batch_timing import is_log_line

    parts = []
    for f in sorted((work / "bench" / "logs").rglob("*.log")):  # the servers' own logs, not the report's tails
        lines = [ln for ln in f.read_text(errors="replace").splitlines() if is_log_line(ln)]
        if lines:
            parts.append(f"==> {f.relative_to(work)} <==\n" + "\n".join(lines))
    return "\n\n".join(parts) + "\n"


def run(a: argparse.Namespace) -> int:
    t_start = time.monotonic()
    if a.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # every child too: the platform rule then says CPU
        # One thread per engine: the rehearsal shares a small machine with its own workers,
        # where OpenMP threads that spin for cores they do not get make it several times slower.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu-run: --device cuda, but torch sees no GPU (use --device cpu for the rehearsal)")
    from rich.console import Console

    from benchmarks.gpu.report import write_gpu_report
    from llmpipe.bench.gpu import GpuSampler
    from llmpipe.bench.plan import Options, build_plans
    from llmpipe.bench.runner import Load, RunConfig, run_plans
    from llmpipe.local.redis_server import EmbeddedRedis
    from llmpipe.models.random_llama import SHAPES, build_random_llama, parameter_count
    from llmpipe.models.tiny import build_tiny

    work, out = Path(a.work), Path(a.out)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out.mkdir(parents=True, exist_ok=True)
    prof = dict(QUICK if a.quick else FULL)
    if a.concurrency:
        prof["concurrency"] = [int(c) for c in a.concurrency.split(",")]
    console = Console(stderr=True, highlight=False)
    result: dict = {"gpu_run": {
        "shape": a.shape, "shape_about": SHAPES[a.shape][0], "parameters": parameter_count(a.shape),
        "device": a.device, "rehearsal": a.device != "cuda", "quick": a.quick, "budget_s": a.budget_s,
        "gpu_name": torch.cuda.get_device_name(0) if a.device == "cuda" else None, "profile": prof,
        "torch": torch.__version__, "steps": {}, "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(["gpu-run", *sys.argv[1:]])}}
    g = result["gpu_run"]
    sampler = GpuSampler().start()
    g["gpu_sampler"] = sampler.name or sampler.unavailable
    try:
        _log(f"building the {a.shape} random-weight model folder ({SHAPES[a.shape][0]})")
        tiny = build_tiny(work / "tiny")
        model = str(build_random_llama(work / f"model-{a.shape}", a.shape, tiny))
        g["steps"]["model_folder_s"] = time.monotonic() - t_start

        _log("batch check: one batch of 32 against 32 single requests")
        t0 = time.monotonic()
        bc = _batch_check(model, prof, work / "batch.json", max_singles_s=a.budget_s * (0.05 if a.quick else 0.15),
                          timeout_s=max(60.0, a.budget_s * 0.4))
        g["batch_check"] = bc
        g["steps"]["batch_check_s"] = time.monotonic() - t0
        _log(f"batch check: batch {bc['batch_s']:.2f} s, single {bc['single_s_mean']:.3f} s, "
             f"speedup {bc['speedup']:.1f}x (engine on {bc.get('device')}, {bc.get('dtype')})")

        left = a.budget_s - (time.monotonic() - t_start) - 20.0  # the report and the stops
        startup = bc["model_load_s"] + 15.0  # workers, API, and the model in the inference worker
        counts, est, dropped = size_points(prof["concurrency"], bc["single_s_mean"], bc["batch_s"], left, startup,
                                           a.quick, a.modes)
        g["sizing"] = {"budget_left_s": left, "estimated_s": est, "startup_estimate_s": startup,
                       "requests": {f"{m} c={c}": n for (m, c), n in counts.items()}, "dropped": dropped}
        if dropped:
            _log(f"left out to fit the budget: {', '.join(dropped)}")
        _log(f"load points sized to ~{est:.0f} s of the {left:.0f} s left: {g['sizing']['requests']}")
        if est > left:
            _log("the estimate is over the budget even at the smallest sizes; running them anyway")

        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
        o = Options(engines=["real"], modes=a.modes, concurrency=prof["concurrency"], rate=None, requests=None,
                    prompt_tokens=prof["prompt_tokens"], max_tokens=prof["max_tokens"], model=model,
                    real_engine="transformers", max_batch=MAX_BATCH, cpu_workers=a.cpu_workers, sim={}, api="jobs",
                    # The study's table compares serial with the pipeline, neither with a monitor;
                    # and Flower is not among the wheels carried to the GPU machine.
                    flower=False)
        plans = build_plans(o, model, tok)
        plan = plans[0]
        plan.setup.label = (f"transformers on a random-weight Llama, {a.shape} shape, "
                            + (f"on {g['gpu_name']} (bf16)" if a.device == "cuda" else "CPU REHEARSAL (float32, not GPU figures)"))
        points = []
        for m, loads in plan.points:
            # Sending stops at 1.5 times the estimate, so that a slow point cannot eat the budget.
            kept = [Load(ld.concurrency, None, counts[(m, ld.concurrency)],
                         max(30.0, 1.5 * counts[(m, ld.concurrency)] * (bc["batch_s"] / min(ld.concurrency, MAX_BATCH)
                                                                      if m in BATCHED else bc["single_s_mean"])))
                    for ld in loads if (m, ld.concurrency) in counts]
            if kept:
                points.append((m, kept))
        plan.points = points
        plan.notes += [f"left out to fit the time budget: {d}" for d in dropped]
        need = max(sum(ld.requests for ld in loads) for _, loads in plan.points) + 4
        if len(plan.prompts) < need:
            from llmpipe.bench.prompts import make_prompts

            plan.prompts = make_prompts(tok, need, prof["prompt_tokens"])

        redis_srv = EmbeddedRedis(work / "redis", appendonly=False).start()
        t0 = time.monotonic()
        try:
            cfg = RunConfig(out=work / "bench", request_timeout_s=max(120.0, a.budget_s), redis_trace=False, gpu=sampler)
            (work / "bench").mkdir()
            result["rows"] = run_plans(plans, cfg, redis_srv.url, console)
        finally:
            redis_srv.stop()
        g["steps"]["bench_s"] = time.monotonic() - t0
        result["plans"] = [{"engine": "real", "label": plan.setup.label, "model_path": model,
                            "prompt_tokens": plan.measured_prompt_tokens, "max_tokens": plan.max_tokens,
                            "max_batch": MAX_BATCH, "cpu_workers": a.cpu_workers, "api": plan.api, "notes": plan.notes}]
        code = 0 if all("summary" in r for r in result["rows"]) else 1
    except Exception as e:  # the report still says what ran and what failed
        g["error"] = f"{type(e).__name__}: {e}"
        g["traceback"] = traceback.format_exc()
        _log(f"failed: {g['error']}")
        code = 1
    finally:
        sampler.stop()
    g["timeline"] = sampler.timeline()
    g["duration_s"] = time.monotonic() - t_start
    files = write_gpu_report(result, work / "report")
    (work / "report" / "run.log").write_text(_log_tails(work))
    (work / "report" / "engine-batches.log").write_text(_engine_batches(work))
    for f in [*files, work / "report" / "run.log", work / "report" / "engine-batches.log"]:
        shutil.copy2(f, out / f.name)
    _log(f"wrote {', '.join(f.name for f in files)} to {out} in {g['duration_s']:.0f} s")
    return code


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu-run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="report.md, results.json and plots go here (at most 8 files)")
    ap.add_argument("--shape", choices=["13b", "1b", "tiny"], default="13b")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--quick", action="store_true",
                    help="rehearsal sizes: short prompts, c=2 and 4, few requests, every mode whatever the budget")
    ap.add_argument("--budget-s", type=float, default=420.0, help="seconds for the whole run, from its start")
    ap.add_argument("--cpu-workers", type=int, default=2)
    ap.add_argument("--modes", type=lambda v: v.split(","), default=list(MODES),
                    help=f"a comma-separated subset of {','.join(MODES)} (a second look at one mode)")
    ap.add_argument("--concurrency", help="comma-separated loads instead of the profile's (16,64; quick 2,4)")
    ap.add_argument("--work", default="/tmp/llmpipe-gpu-run", help="scratch: models, logs, Redis")
    a = ap.parse_args(argv)
    if not a.modes or set(a.modes) - set(MODES):
        ap.error(f"--modes: choose from {', '.join(MODES)}")
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
