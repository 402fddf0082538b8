"""The GPU run's report: report.md, results.json and plots, in one folder of at most 8 files.

Every figure comes from the run's own rows. A CPU rehearsal is labelled as one at the
top, in the table's title and in the plots, so that nobody takes it for GPU figures.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from llmpipe.bench.report import _batch_text, _ms, breakdown_table, cpu_table, results_table


def _gpu_cell(row: dict, key: str) -> str:
    g = (row.get("gpu") or {}).get("steady") or {}
    if "unavailable" in g:
        return "n/a"
    if not g.get("samples"):
        return "no samples"
    if key == "util":
        return f"{g['util_mean_pct']:.0f}% (p50 {g['util_p50_pct']:.0f}%)"
    return f"{g['mem_used_max_mib'] / 1024:.1f} GiB"


def study_table(rows: list[dict]) -> list[str]:
    out = ["| mode | load | requests (measured, errors) | p50 ms | p99 ms | req/s | output tok/s | GPU utilization, "
           "steady window: mean (p50) | GPU memory, max | engine busy | batch size: mean (size:requests) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "summary" not in r:
            out.append(f"| {r['mode']} | {r['load']} | failed: {str(r.get('error', ''))[:120]} | | | | | | | | |")
            continue
        s = r["summary"]
        busy = s.get("engine_busy") or {}
        out.append(f"| {r['mode']} | {r['load']} | {r['requests']} ({s['measured']}, {s['errors']}) | "
                   f"{_ms(s['latency_s']['p50'])} | {_ms(s['latency_s']['p99'])} | {s['throughput_rps']:.2f} | "
                   f"{s['output_tok_s']:.0f} | {_gpu_cell(r, 'util')} | {_gpu_cell(r, 'mem')} | "
                   f"{busy.get('fraction', 0) * 100:.0f}% | {_batch_text(s)} |")
    return out


def comparisons(rows: list[dict]) -> list[str]:
    """pipeline-window50 against serial at each load, from the rows."""
    out = []
    by = {(r["mode"], r["load"]): r for r in rows if "summary" in r}
    for (mode, load), b in by.items():
        s = by.get(("serial", load))
        if mode != "pipeline-window50" or s is None:
            continue
        rb, rs = b["summary"]["throughput_rps"], s["summary"]["throughput_rps"]
        pb, ps = b["summary"]["latency_s"]["p99"], s["summary"]["latency_s"]["p99"]
        line = f"- {load}: throughput {rb:.2f} vs {rs:.2f} req/s ({rb / rs:.1f}x)" if rs else f"- {load}:"
        if pb and ps:
            line += f"; p99 {pb * 1000:.0f} vs {ps * 1000:.0f} ms ({pb / ps:.2f}x)"
        gb, gs = (x.get("gpu", {}).get("steady", {}) for x in (b, s))
        if gb.get("samples") and gs.get("samples"):
            line += f"; GPU utilization {gb['util_mean_pct']:.0f}% vs {gs['util_mean_pct']:.0f}%"
        out.append(line)
    return out


def markdown(result: dict) -> str:
    g = result["gpu_run"]
    rows = result.get("rows", [])
    rehearsal = g["rehearsal"]
    title = "CPU rehearsal of the GPU run" if rehearsal else f"The pipeline on a GPU: {g.get('gpu_name')}"
    lines = [f"# {title}", ""]
    if rehearsal:
        lines += ["**CPU REHEARSAL: everything below ran on the CPU, with the transformers engine in float32 on a "
                  f"{g['shape']} shape. These are not GPU figures; they prove that the script runs end to end.**", ""]
    lines += [f"Started {g.get('started', '')}; {g['duration_s']:.0f} s in all. torch {g['torch']}. "
              f"GPU sampler: {g.get('gpu_sampler')}.", "",
              f"Model: a random-weight Llama, {g['shape_about']}, {g['parameters'] / 1e9:.2f} B parameters, built from "
              "its config on the device (no checkpoint; outputs are noise, the cost per token is the shape's). "
              f"Prompts ~{g['profile']['prompt_tokens']} tokens, {g['profile']['max_tokens']} output tokens (ignore_eos), "
              f"closed loop at concurrency {', '.join(map(str, g['profile']['concurrency']))}, through the job API.", ""]
    if g.get("error"):
        lines += [f"**The run failed: {g['error']}**", "", "```", g.get("traceback", "").strip()[-3000:], "```", ""]
    bc = g.get("batch_check")
    if bc:
        from benchmarks.gpu.batch_check import describe

        lines += ["## Does the engine batch?", "",
                  f"The engine of the pipeline (`create_engine`: {bc.get('device')}, {bc.get('dtype')}), "
                  f"{bc['requests']} prompts of ~{bc['prompt_tokens_mean']:.0f} tokens, {bc['max_tokens']} output "
                  "tokens each, after one warm-up of each shape: " + describe(bc) + ".", ""]
        timing = {k: v for k, v in (bc.get("timing") or {}).items() if v}
        if timing:  # wall against the engine thread's CPU (llmpipe/engines/batch_timing.py)
            lines += ["The engine's own split: " + "; ".join(f"{k}: {v}" for k, v in timing.items())
                      + ". The pipeline's batches are in engine-batches.log.", ""]
    if rows:
        lines += ["## The study's modes", "", *study_table(rows), ""]
        comp = comparisons(rows)
        if comp:
            lines += ["pipeline-window50 against serial, from the rows above:", "", *comp, ""]
        for note in (result.get("plans") or [{}])[0].get("notes", []):
            lines += [f"- {note}"]
        lines += [""] + (["![GPU utilization over the run](gpu_util.png)", ""] if g.get("timeline") else [])
        lines += ["![latency CDF](latency_cdf_real.png)", "",
                  "## Details", "", *results_table(rows), "", "CPU per stage:", "", *cpu_table(rows), ""]
        bt = breakdown_table(rows)
        if bt:
            lines += ["Where the time goes (p50 of the server's per-stage timings, ms):", "", *bt, ""]
    if g.get("sizing"):
        lines += ["## How the run was sized", "", f"Requests per load point, sized from the batch check to fit the "
                  f"{g['budget_s']:.0f} s budget (estimate {g['sizing']['estimated_s']:.0f} s for the load points): "
                  + ", ".join(f"{k}: {v}" for k, v in g["sizing"]["requests"].items()) + ". Steps: "
                  + ", ".join(f"{k} {v:.0f} s" for k, v in g["steps"].items()) + ".", ""]
    lines += ["GPU utilization is nvidia-smi's `utilization.gpu` (the share of each 0.5 s in which a kernel ran), "
              "averaged over the samples inside each load point's steady window (the one its rates use). "
              "Latency, throughput and engine busy are defined as in `llmpipe bench` (docs/benchmarks.md).", ""]
    return "\n".join(lines)


def util_plot(result: dict, path: Path) -> bool:
    g = result["gpu_run"]
    if not g.get("timeline"):
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = g["timeline"][0][0]
    fig, ax = plt.subplots(figsize=(11, 4))
    ax.plot([s[0] - t0 for s in g["timeline"]], [s[1] for s in g["timeline"]], lw=0.8, color="black")
    colors = {"serial": "tab:red", "pipeline-nobatch": "tab:orange", "pipeline-window50": "tab:green"}
    for r in result.get("rows", []):
        if r.get("span"):
            a, b = (x - t0 for x in r["span"])
            ax.axvspan(a, b, alpha=0.15, color=colors.get(r["mode"], "tab:blue"))
            ax.text((a + b) / 2, 102, f"{r['mode']}\n{r['load']}", ha="center", va="bottom", fontsize=7)
    ax.set_ylim(0, 125)
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel("GPU utilization (%)")
    ax.set_title(f"GPU utilization, every 0.5 s: {g.get('gpu_name')}, {g['shape']} shape", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_gpu_report(result: dict, folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    result["gpu_run"].setdefault("started", time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    files = []
    try:
        from llmpipe.bench.report import plots

        made = plots({"plans": result.get("plans", []), "rows": result.get("rows", [])}, folder)
        files += [folder / p for ps in made.values() for p in ps]
        if util_plot(result, folder / "gpu_util.png"):
            files.append(folder / "gpu_util.png")
    except ImportError as e:  # no matplotlib: the tables still say it all
        result["gpu_run"]["plots"] = f"left out: {e}"
    (folder / "results.json").write_text(json.dumps(result, separators=(",", ":"), default=str))
    (folder / "report.md").write_text(markdown(result))
    return [folder / "report.md", folder / "results.json", *files]
