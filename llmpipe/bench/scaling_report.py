"""Figures of the scaling run: speed-ups against one worker, per-worker batches, CPU use,
what the hops add to the latency, the targets; written as results.json, report.md and
two plots."""

from __future__ import annotations

import json
from pathlib import Path

from llmpipe.bench.plots import missing

TARGETS = {2: 1.9, 4: 3.5}  # throughput with N workers against one, in the same run
FULL_BATCH = 0.9  # a worker's mean batch at or above this share of the max batch counts as full


def _ok(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "summary" in r]


def _find(rows: list[dict], layout: str, workers: int, c: int) -> dict | None:
    hit = [r for r in _ok(rows) if r["layout"] == layout and r["workers"] == workers and r["concurrency"] == c]
    return hit[-1] if hit else None


def _pipeline_cpu(row: dict) -> tuple[float, float]:
    """(CPU seconds of every serving process, share of the machine's cores) in the point."""
    c = row["cpu"]
    used = sum(v for g, v in c["cpu_s"].items() if g != "loadgen")
    return used, used / (c["wall_s"] * c["cores"])


def analyze(rows: list[dict], hops: str, max_batch: int, concurrency: list[int], network_c: list[int],
            quick: bool) -> dict:
    scaling, targets, network = [], [], []
    for c in concurrency:
        one = _find(rows, hops, 1, c)
        for w in sorted({r["workers"] for r in _ok(rows) if r["layout"] == hops}):
            r = _find(rows, hops, w, c)
            if r is None:
                continue
            x = r["summary"]["throughput_rps"]
            speedup = x / one["summary"]["throughput_rps"] if one else None
            means = {k: v["mean_batch"] for k, v in r["per_worker"].items()}
            cpu_s, share = _pipeline_cpu(r)
            # The load generator and other users' processes share the cores: a point where
            # the machine is busy all the time is CPU-bound, whatever the GPU workers could do.
            machine = r["cpu"]["wall_s"] * r["cpu"]["cores"]
            scaling.append({"concurrency": c, "workers": w, "throughput_rps": x, "speedup": speedup,
                            "capacity_rps": r["capacity_rps"], "of_capacity": x / r["capacity_rps"],
                            "p50_s": r["summary"]["latency_s"]["p50"], "p99_s": r["summary"]["latency_s"]["p99"],
                            "mean_batch_per_worker": means, "errors": r["summary"]["errors"],
                            "cpu_ms_per_request": cpu_s / max(1, r["requests"]) * 1000, "cpu_share": share,
                            "loadgen_cpu_share": r["cpu"]["cpu_s"].get("loadgen", 0.0) / machine,
                            "other_cpu_share": r["cpu"]["other_cpu_s"] / machine,
                            "machine_busy": r["cpu"]["system_cpu_s"] / machine})
            if quick:
                continue
            if w in TARGETS and speedup is not None:
                targets.append({"name": f"throughput, {w} workers vs 1, c={c}", "target": f">= {TARGETS[w]}x",
                                "value": speedup, "met": speedup >= TARGETS[w],
                                "detail": f"{x:.2f} vs {one['summary']['throughput_rps']:.2f} req/s"})
            full = [m for m in means.values() if m is not None]
            low = min(full) if full else None
            targets.append({"name": f"batches stay full, {w} worker(s), c={c}",
                            "target": f"every worker's mean batch >= {FULL_BATCH * max_batch:g} (max {max_batch})",
                            "value": low, "met": low is not None and len(full) == w and low >= FULL_BATCH * max_batch,
                            "detail": ", ".join(f"{k} {v:.2f}" if v else f"{k} n/a" for k, v in means.items())})
    for c in network_c:
        a, b = _find(rows, "one-host", 1, c), _find(rows, hops, 1, c)
        if a and b:
            la, lb = a["summary"]["latency_s"], b["summary"]["latency_s"]
            network.append({"concurrency": c, "one_host": {"p50_s": la["p50"], "p99_s": la["p99"]},
                            "hops": {"p50_s": lb["p50"], "p99_s": lb["p99"]},
                            "added_p50_s": lb["p50"] - la["p50"], "added_p99_s": lb["p99"] - la["p99"],
                            "throughput_rps": {"one_host": a["summary"]["throughput_rps"],
                                               "hops": b["summary"]["throughput_rps"]}})
    return {"scaling": scaling, "network": network, "targets": targets}


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1000:.0f}"


def markdown(result: dict) -> str:
    m, a = result["meta"], result["analysis"]
    lines = [f"# Scaling across hosts ({m['started']})", "", f"Command: `{m['command']}`", "",
             f"Machine: {m['machine']}. Load average {m['loadavg_start']} before, {m['loadavg_end']} after; "
             f"took {m['duration_s']:.0f} s.", "", result["conditions"], "",
             "## Throughput against inference workers", "",
             "| c | workers | req/s | speed-up vs 1 | of capacity | p50 ms | p99 ms | mean batch per worker "
             "| errors | CPU ms/req | CPU use (machine) | load generator | other processes | machine busy |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in a["scaling"]:
        means = ", ".join(f"{v:.1f}" if v else "n/a" for v in s["mean_batch_per_worker"].values())
        sp = "n/a" if s["speedup"] is None else f"{s['speedup']:.2f}x"
        lines.append(f"| {s['concurrency']} | {s['workers']} | {s['throughput_rps']:.2f} | {sp} | "
                     f"{s['of_capacity'] * 100:.0f}% | {_ms(s['p50_s'])} | {_ms(s['p99_s'])} | {means} | {s['errors']} | "
                     f"{s['cpu_ms_per_request']:.0f} | {s['cpu_share'] * 100:.0f}% | {s['loadgen_cpu_share'] * 100:.0f}% | "
                     f"{s['other_cpu_share'] * 100:.0f}% | {s['machine_busy'] * 100:.0f}% |")
    lines += ["", "## What the hops add (one inference worker)", "",
              "| c | one host p50 / p99 ms | hosts p50 / p99 ms | added p50 ms | added p99 ms | req/s one host / hosts |",
              "|---|---|---|---|---|---|"]
    for n in a["network"]:
        lines.append(f"| {n['concurrency']} | {_ms(n['one_host']['p50_s'])} / {_ms(n['one_host']['p99_s'])} | "
                     f"{_ms(n['hops']['p50_s'])} / {_ms(n['hops']['p99_s'])} | {_ms(n['added_p50_s'])} | "
                     f"{_ms(n['added_p99_s'])} | {n['throughput_rps']['one_host']:.2f} / {n['throughput_rps']['hops']:.2f} |")
    if a["targets"]:
        lines += ["", "## Targets", "", "| target | wanted | measured | met | detail |", "|---|---|---|---|---|"]
        for t in a["targets"]:
            v = "n/a" if t["value"] is None else f"{t['value']:.2f}"
            lines.append(f"| {t['name']} | {t['target']} | {v} | {'yes' if t['met'] else 'no'} | {t['detail']} |")
    failed = [r for r in result["rows"] if "error" in r]
    if failed:
        lines += ["", "## Failed points", ""] + [f"* {r['layout']} workers={r['workers']} c={r['concurrency']}: "
                                                  f"{r['error'][:300]}" for r in failed]
    return "\n".join(lines) + "\n"


def plots(result: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a, files = result["analysis"], []
    if a["scaling"]:
        fig, ax = plt.subplots(figsize=(6, 4))
        for c in sorted({s["concurrency"] for s in a["scaling"]}):
            pts = sorted((s["workers"], s["throughput_rps"]) for s in a["scaling"] if s["concurrency"] == c)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"measured, c={c}")
        cap = sorted({(s["workers"], s["capacity_rps"]) for s in a["scaling"]})
        ax.plot([p[0] for p in cap], [p[1] for p in cap], "k--", label="capacity (full batches back to back)")
        ax.set_xlabel("inference workers (one host each)")
        ax.set_ylabel("throughput (req/s)")
        ax.set_xticks(sorted({s["workers"] for s in a["scaling"]}))
        ax.set_title("SIMULATED GPU, 20 ms round trip between hosts")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        files.append(out / "scaling_hosts.png")
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
    net = [r for r in result["rows"] if "summary" in r and r["workers"] == 1
           and r["concurrency"] in {n["concurrency"] for n in a["network"]}]
    if net:
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in sorted(net, key=lambda r: (r["concurrency"], r["layout"])):
            xs = r["latencies_s"]
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=f"{r['layout']}, c={r['concurrency']}")
        ax.set_xscale("log")
        ax.set_xlabel("latency (s, log)")
        ax.set_ylabel("share of requests")
        ax.set_title("One inference worker: one host against hosts with hops")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        files.append(out / "network_latency_cdf.png")
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
    return files


def write(result: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    why = missing()
    if why:
        result["plots"] = why
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "report.md").write_text(markdown(result))
    return [out / "results.json", out / "report.md", *([] if why else plots(result, out))]
