"""The run's outputs: results.json, report.md (tables) and PNG plots."""

from __future__ import annotations

import json
import math
from pathlib import Path

STAGE_ORDER = ["api", "preprocess", "inference", "postprocess", "redis", "serial", "vllm-serve", "loadgen"]


def _ms(v: float | None) -> str:
    return "n/a" if v is None else (f"{v * 1000:.1f}" if v < 0.1 else f"{v * 1000:.0f}")


def _batch_text(s: dict) -> str:
    bs = s.get("batch_sizes")
    if not bs:
        return "n/a"
    top = sorted(bs.items(), key=lambda kv: -kv[1])[:4]
    return f"{s['batch_size_mean']:.1f} ({', '.join(f'{k}:{v}' for k, v in sorted(top, key=lambda kv: int(kv[0])))})"


def _engine_rows(rows: list[dict], engine: str) -> list[dict]:
    return [r for r in rows if r["engine"] == engine]


def results_table(rows: list[dict]) -> list[str]:
    out = ["| mode | load | requests (measured, errors) | p50 ms | p90 ms | p99 ms | TTFT p50 ms | req/s | output tok/s "
           "| engine busy | batch size: mean (size:requests) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "summary" not in r:
            out.append(f"| {r['mode']} | {r['load']} | failed: {r.get('error', '')[:120]} | | | | | | | | |")
            continue
        s = r["summary"]
        lat, ttft = s["latency_s"], s["ttft_s"]
        busy = s["engine_busy"]
        busy_txt = f"{busy['fraction'] * 100:.0f}%" + (" (client)" if busy["method"].startswith("client") else "")
        load = r["load"] + (f" ({s['offered_rps']:.2f} offered)" if s.get("offered_rps") else "")
        out.append(
            f"| {r['mode']} | {load} | {r['requests']} ({s['measured']}, {s['errors']}) | {_ms(lat['p50'])} | "
            f"{_ms(lat['p90'])} | {_ms(lat['p99'])} | {_ms(ttft['p50']) if ttft else 'n/a'} | "
            f"{s['throughput_rps']:.2f} | {s['output_tok_s']:.0f} | {busy_txt} | {_batch_text(s)} |")
    return out


def cpu_table(rows: list[dict]) -> list[str]:
    have = [r for r in rows if "cpu" in r]
    if not have:
        return []
    groups = [g for g in STAGE_ORDER if any(g in r["cpu"]["cpu_s"] for r in have)]
    out = ["| mode | load | wall s | " + " | ".join(groups) + " | other processes | servers: CPU ms/req → req/s bound |",
           "|---|---|---|" + "---|" * len(groups) + "---|---|"]
    for r in have:
        c, n = r["cpu"], max(1, r["requests"])
        cells = []
        for g in groups:
            v = c["cpu_s"].get(g)
            cells.append("" if v is None else f"{v / c['wall_s'] * 100:.0f}% ({v / n * 1000:.1f} ms/req)")
        cells.append(f"{c['other_cpu_s'] / c['wall_s'] * 100:.0f}%")
        # What the serving processes (not the load generator) burn per request, and the
        # throughput all the machine's cores would allow at that cost.
        ms = sum(v for g, v in c["cpu_s"].items() if g != "loadgen") / n * 1000
        cells.append(f"{ms:.1f} → {c['cores'] * 1000 / ms:.0f}" if ms > 0 else "n/a")
        out.append(f"| {r['mode']} | {r['load']} | {c['wall_s']:.1f} | " + " | ".join(cells) + " |")
    return out


def redis_table(rows: list[dict]) -> list[str]:
    have = [r for r in rows if r.get("redis")]
    if not have:
        return []
    out = ["| mode | load | Redis commands / request | top commands / request | bytes in / out per request |",
           "|---|---|---|---|---|"]
    for r in have:
        d = r["redis"]
        top = ", ".join(f"{k} {v:g}" for k, v in list(d["by_command_per_request"].items())[:8])
        out.append(f"| {r['mode']} | {r['load']} | {d['commands_per_request']:.1f} | {top} | "
                   f"{d['bytes_in_per_request'] / 1024:.1f} KiB / {d['bytes_out_per_request'] / 1024:.1f} KiB |")
    return out


def breakdown_table(rows: list[dict]) -> list[str]:
    have = [r for r in rows if (r.get("summary") or {}).get("stage_p50_s")]
    if not have:
        return []
    out = ["| mode | load | preprocess wait / run | inference wait / run (batch wait + engine) | postprocess wait / run "
           "| rest: API, chord collect, result, HTTP (≈) | end-to-end p50 |", "|---|---|---|---|---|---|---|"]
    for r in have:
        st, e2e = r["summary"]["stage_p50_s"], r["summary"]["latency_s"]["p50"]
        cells, total = [], 0.0
        for stage in ("preprocess", "inference", "postprocess"):
            w, run = st.get(stage, {}).get("queue_wait_s", 0.0), st.get(stage, {}).get("run_s", 0.0)
            total += w + run
            cells.append(f"{_ms(w)} / {_ms(run)}")
        out.append(f"| {r['mode']} | {r['load']} | " + " | ".join(cells) + f" | {_ms(max(0.0, e2e - total))} | {_ms(e2e)} |")
    return out


def trace_table(rows: list[dict]) -> list[str]:
    have = [r for r in rows if r.get("redis_trace")]
    if not have:
        return []
    t = have[0]["redis_trace"]
    out = [f"Redis commands per request by purpose (MONITOR while {t['requests']} requests ran one at a time; "
           f"background commands/s subtracted), per traced mode:", "",
           "| purpose | " + " | ".join(r["mode"] for r in have) + " |", "|---|" + "---|" * len(have)]
    purposes = list(dict.fromkeys(k for r in have for k in r["redis_trace"]["per_request"]))
    for k in purposes:
        cells = []
        for r in have:
            tr = r["redis_trace"]
            v = tr["per_request"].get(k)
            cells.append("" if v is None else f"{v:g} ({', '.join(f'{c} {n:g}' for c, n in tr['commands'][k].items())})")
        out.append(f"| {k} | " + " | ".join(cells) + " |")
    out.append("| **total** | " + " | ".join(f"**{r['redis_trace']['total_per_request']:g}**" for r in have) + " |")
    lags = [(r["mode"], r["stream_end"]) for r in rows if r.get("stream_end", {}).get("p50_ms") is not None]
    for mode, lag in lags:
        out += ["", f"{mode}: a stream ends {lag['p50_ms']:.1f} ms (p50), {lag['p90_ms']:.1f} ms (p90) after its job "
                f"completed ({lag['n']} streaming requests one at a time; the client's [DONE] minus the job record's "
                "terminal write)."]
    return out


def targets_table(targets: list[dict]) -> list[str]:
    out = ["| target | wanted | measured | met | how |", "|---|---|---|---|---|"]
    for t in targets:
        v = "n/a" if t["value"] is None else f"{t['value']:.2f}"
        out.append(f"| {t['name']} | {t['target']} | {v} | {'yes' if t['met'] else '**no**'} | {t['detail']} |")
    return out


def markdown(result: dict, plots: dict[str, list[str]]) -> str:
    meta = result["meta"]
    lines = [f"# llmpipe bench: {meta['started']}", "", f"Command: `{meta['command']}`", "",
             f"Machine: {meta['machine']}", "", "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
             "", f"Duration: {meta['duration_s']:.0f} s. Load average before / after: {meta['loadavg_start']} / "
             f"{meta['loadavg_end']} (other processes share this machine; see the 'other processes' CPU column).", ""]
    if result["targets"]:
        lines += ["## Targets (ratios from this run)", "", *targets_table(result["targets"]), ""]
    for plan in result["plans"]:
        key = plan["engine"]
        rows = _engine_rows(result["rows"], key)
        lines += [f"## {plan['label']}", "", f"Engine `{key}`. {plan['settings_text']}", ""]
        lines += [f"- {n}" for n in plan["notes"]] + ([""] if plan["notes"] else [])
        lines += results_table(rows) + [""]
        lines += ["CPU per stage, as % of one core over the load point (and CPU ms per request); the last column is "
                  "the serving processes' CPU per request and the req/s that all cores could sustain at that cost:",
                  ""] + cpu_table(rows) + [""]
        bt = breakdown_table(rows)
        if bt:
            lines += ["Where the time goes (p50 of the server's per-stage timings, ms):", ""] + bt + [""]
        rt = redis_table(rows)
        if rt:
            lines += ["Redis traffic (INFO commandstats deltas over the load point):", ""] + rt + [""]
        tt = trace_table(rows)
        if tt:
            lines += tt + [""]
        for p in plots.get(key, []):
            lines += [f"![{p}]({p})", ""]
    lines += ["Latency: client-observed, from sending the request to having the whole result. Closed loop: the first "
              "`concurrency` requests (the initial burst) and, when at least 8 remain, the last `concurrency` (sent "
              "while the load drains) are left out ('measured' counts the rest). Throughput, closed loop: concurrency / "
              "mean latency of the measured requests (Little's law; no think time), which is robust to completions "
              "that come in bursts of a batch; open loop: completions / time. Output tok/s: throughput x mean output "
              "tokens. Engine busy: share of the steady window (first measured request sent to last request sent) in "
              "which the engine had work: the union of per-request engine intervals (stage timings + engine_time_s) "
              "where the server reports them (approximate: a batch's interval is taken per request, from when its "
              "Celery task returned), else '(client)': the union of in-flight requests, an upper bound. TTFT: only "
              "where the client streams (POST /v1/completions); n/a on the job API.", ""]
    return "\n".join(lines)


def plots(result: dict, out: Path) -> dict[str, list[str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401

    made: dict[str, list[str]] = {}
    for plan in result["plans"]:
        key, label = plan["engine"], plan["label"]
        rows = [r for r in _engine_rows(result["rows"], key) if "summary" in r]
        if not rows:
            continue
        modes = list(dict.fromkeys(r["mode"] for r in rows))
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for m in modes:
            mr = [r for r in rows if r["mode"] == m]
            top = mr[-1]
            xs = [x * 1000 for x in top["cdf"]]
            if xs:
                ax.step([xs[0], *xs], [0.0, *((i + 1) / len(xs) for i in range(len(xs)))], where="post",
                        label=f"{m} ({top['load']}, n={len(xs)})")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(
            lambda v, _: f"{v:g}" if v > 0 and round(v / 10 ** math.floor(math.log10(v))) in (2, 5) else ""))
        ax.set_xlabel("latency (ms, log scale)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"Latency CDF: {label}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        name = f"latency_cdf_{key}.png"
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        made.setdefault(key, []).append(name)
        xkey = "concurrency" if rows[0]["concurrency"] is not None else "rate"
        if len({r[xkey] for r in rows}) < 2:
            continue
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
        for m in modes:
            mr = sorted((r for r in rows if r["mode"] == m), key=lambda r: r[xkey])
            x = [r[xkey] for r in mr]
            a1.plot(x, [r["summary"]["throughput_rps"] for r in mr], marker="o", label=m)
            a2.plot(x, [(r["summary"]["latency_s"]["p99"] or 0) * 1000 for r in mr], marker="o", label=m)
        for a, yl in ((a1, "throughput (req/s)"), (a2, "p99 latency (ms)")):
            a.set_xlabel("concurrency (closed loop)" if xkey == "concurrency" else "offered rate (req/s)")
            a.set_ylabel(yl)
            a.grid(True, alpha=0.3)
            a.legend(fontsize=8)
        a2.set_yscale("log")
        fig.suptitle(f"Throughput and p99 against load: {label}", fontsize=10)
        name = f"scaling_{key}.png"
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        made[key].append(name)
    return made


def write_all(result: dict, out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    made = plots(result, out)
    (out / "results.json").write_text(json.dumps(result, separators=(",", ":"), default=str))
    (out / "report.md").write_text(markdown(result, made))
    return {"json": out / "results.json", "markdown": out / "report.md",
            **{p: out / p for ps in made.values() for p in ps}}
