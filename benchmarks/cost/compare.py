"""Before/after: the per-request cost against the celery floor from two ``llmpipe bench`` runs, each with the
celery floor and the pipeline (``--engine noop --modes celery-floor,pipeline-window50
--concurrency 1,64``), one on the code before and one after. Writes ``report.md`` (the
table) and ``cost.png`` (capacity and idle overhead of floor, before and after).

``python -m benchmarks.cost.compare BEFORE_DIR AFTER_DIR [--out DIR] [--events-off DIR ...]``
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from llmpipe.bench.targets import servers_cpu_ms

MODE, FLOOR = "pipeline-window50", "celery-floor"


def _row(result: dict, mode: str, load: str) -> dict | None:
    return next((r for r in result["rows"] if r["mode"] == mode and r["load"] == load and "summary" in r), None)


def figures(result: dict, mode: str) -> dict:
    """The issue's figures of one mode in one run."""
    hi, lo = _row(result, mode, "c=64"), _row(result, mode, "c=1")
    trace = next((r["redis_trace"] for r in result["rows"] if r["mode"] == mode and r.get("redis_trace")), None)
    lag = (lo or {}).get("stream_end") or {}
    return {
        "capacity_rps": hi["summary"]["throughput_rps"] if hi else None,
        "idle_overhead_ms": lo["summary"]["overhead_s"]["p50"] * 1000 if lo and lo["summary"].get("overhead_s") else None,
        "idle_p50_ms": lo["summary"]["latency_s"]["p50"] * 1000 if lo else None,
        "cpu_ms": servers_cpu_ms(hi) if hi else None,
        "cpu_ms_idle": servers_cpu_ms(lo) if lo else None,
        "redis_cmds": trace["total_per_request"] if trace else None,
        "redis_by_purpose": trace["per_request"] if trace else None,
        "stream_end_ms": lag.get("p50_ms"),
        "other_cpu_pct": round(100 * hi["cpu"]["other_cpu_s"] / hi["cpu"]["wall_s"]) if hi else None,
    }


def _f(v: float | None, fmt: str = "{:.1f}") -> str:
    return "n/a" if v is None else fmt.format(v)


def table(runs: dict[str, dict]) -> list[str]:
    """``runs``: label -> results.json of a run holding the floor and the pipeline."""
    out = ["| run | mode | capacity c=64, req/s (x floor) | idle overhead p50, ms (floor +) | serving CPU, ms/req at c=64 "
           "(x floor) | Redis cmds/req (floor +) | stream end after job, p50 ms | other processes at c=64 | load avg |",
           "|---|---|---|---|---|---|---|---|---|"]
    for label, res in runs.items():
        fl = figures(res, FLOOR)
        la = f"{res['meta']['loadavg_start'].split()[0]} → {res['meta']['loadavg_end'].split()[0]}"
        for mode in (FLOOR, MODE):
            f = figures(res, mode)
            if f["capacity_rps"] is None and f["idle_overhead_ms"] is None:
                continue
            floor = mode == FLOOR

            def rel(a, b, how):
                if floor or a is None or b is None:
                    return ""
                return f" ({a / b:.2f}x)" if how == "x" else f" ({a - b:+.1f})"

            out.append(f"| {label} | {mode} | {_f(f['capacity_rps'])}{rel(f['capacity_rps'], fl['capacity_rps'], 'x')} | "
                       f"{_f(f['idle_overhead_ms'])}{rel(f['idle_overhead_ms'], fl['idle_overhead_ms'], '+')} | "
                       f"{_f(f['cpu_ms'])}{rel(f['cpu_ms'], fl['cpu_ms'], 'x')} | "
                       f"{_f(f['redis_cmds'], '{:g}')}{rel(f['redis_cmds'], fl['redis_cmds'], '+')} | "
                       f"{'' if floor else _f(f['stream_end_ms'])} | {_f(f['other_cpu_pct'], '{:.0f}%')} | {la} |")
    return out


def redis_table(runs: dict[str, dict]) -> list[str]:
    cols = [(label, mode, figures(res, mode)["redis_by_purpose"] or {}) for label, res in runs.items()
            for mode in (FLOOR, MODE)]
    cols = [c for c in cols if c[2]]
    purposes = list(dict.fromkeys(k for _, _, p in cols for k in p))
    out = ["| purpose | " + " | ".join(f"{m} ({lb})" for lb, m, _ in cols) + " |", "|---|" + "---|" * len(cols)]
    for k in purposes:
        out.append(f"| {k} | " + " | ".join(_f(p.get(k), "{:g}") if k in p else "" for _, _, p in cols) + " |")
    out.append("| **total** | " + " | ".join(f"**{sum(p.values()):.1f}**" for _, _, p in cols) + " |")
    return out


def plot(runs: dict[str, dict], path: Path) -> None:
    """Per run (before, after...), the floor and the pipeline side by side: each run's own
    floor, since machine load moves both between runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(runs)
    figs = {label: (figures(res, FLOOR), figures(res, MODE)) for label, res in runs.items()}
    fig, axes = plt.subplots(1, 3, figsize=(max(13.0, 2.6 * len(labels)), 4.4))
    panels = ((axes[0], "capacity_rps", "capacity at c=64 (req/s, higher is better)"),
              (axes[1], "idle_overhead_ms", "idle overhead p50 (ms, lower is better)"),
              (axes[2], "cpu_ms", "serving CPU per request at c=64 (ms, lower is better)"))
    w = 0.38
    for ax, key, title in panels:
        for j, (name, color) in enumerate((("celery floor", "#888888"), ("pipeline", "#1f77b4"))):
            xs = [i + (j - 0.5) * w for i in range(len(labels))]
            vals = [figs[lb][j][key] or 0 for lb in labels]
            ax.bar(xs, vals, w, label=name, color=color)
            for x, v in zip(xs, vals, strict=True):
                ax.text(x, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(labels)), labels, rotation=25, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=8)
    fig.suptitle("noop engine, 2 shared cores: the pipeline against the celery floor of the same run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="LABEL=DIR of a bench run (e.g. before=/tmp/b after=/tmp/a)")
    p.add_argument("--out", type=Path, default=Path("bench-results/cost"))
    a = p.parse_args(argv)
    runs = {}
    for spec in a.runs:
        label, _, d = spec.partition("=")
        runs[label] = json.loads((Path(d) / "results.json").read_text())
    a.out.mkdir(parents=True, exist_ok=True)
    lines = ["# Per-request cost against the celery floor", "",
             "Each run: `llmpipe bench --engine noop --modes celery-floor,pipeline-window50 --concurrency 1,64`, "
             "the floor and the pipeline back to back. Ratios and differences are to the floor of the same run.", "",
             *table(runs), "", "Redis commands per request by purpose (MONITOR, 10 idle requests, background "
             "subtracted):", "", *redis_table(runs), "", "![capacity and idle overhead](cost.png)", ""]
    for label, res in runs.items():
        lines.append(f"- {label}: {res['meta']['command']}, started {res['meta']['started']}, "
                     f"{res['meta']['duration_s']:.0f} s, load average {res['meta']['loadavg_start']} → "
                     f"{res['meta']['loadavg_end']}")
    (a.out / "report.md").write_text("\n".join(lines) + "\n")
    (a.out / "figures.json").write_text(json.dumps({k: {m: figures(v, m) for m in (FLOOR, MODE)} for k, v in runs.items()},
                                                   indent=1))
    plot(runs, a.out / "cost.png")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
