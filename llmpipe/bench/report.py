"""The run's outputs: results.json, report.md (tables) and the PNG plots (plots.py)."""

from __future__ import annotations

import json
from pathlib import Path

from llmpipe.bench.plots import missing, plots
from llmpipe.bench.vllm_report import comparison_table, misses

STAGE_ORDER = ["api", "preprocess", "inference", "postprocess", "redis", "flower", "serial", "vllm-serve",
               "vllm-serve-matched", "loadgen"]


def _ms(v: float | None) -> str:
    return "n/a" if v is None else (f"{v * 1000:.1f}" if v < 0.1 else f"{v * 1000:.0f}")


def _batch_text(s: dict) -> str:
    bs = s.get("batch_sizes")
    if not bs:
        return "n/a"
    top = sorted(bs.items(), key=lambda kv: -kv[1])[:4]
    return f"{s['batch_size_mean']:.1f} ({', '.join(f'{k}:{v}' for k, v in sorted(top, key=lambda kv: int(kv[0])))})"


def _kind(r: dict) -> str:
    return r.get("kind", "jobs")


def _engine_rows(rows: list[dict], engine: str) -> list[dict]:
    return [r for r in rows if r["engine"] == engine]


def results_table(rows: list[dict]) -> list[str]:
    out = ["| mode | kind | load | requests (measured, errors) | p50 ms | p90 ms | p99 ms | TTFT p50 ms | req/s "
           "| output tok/s | engine busy | batch size: mean (size:requests) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "summary" not in r:
            out.append(f"| {r['mode']} | {_kind(r)} | {r['load']} | failed: {r.get('error', '')[:120]} | | | | | | | | |")
            continue
        s = r["summary"]
        lat, ttft = s["latency_s"], s["ttft_s"]
        busy = s["engine_busy"]
        busy_txt = f"{busy['fraction'] * 100:.0f}%" + (" (client)" if busy["method"].startswith("client") else "")
        load = r["load"] + (f" ({s['offered_rps']:.2f} offered)" if s.get("offered_rps") else "")
        out.append(
            f"| {r['mode']} | {_kind(r)} | {load} | {r['requests']} ({s['measured']}, {s['errors']}) | {_ms(lat['p50'])} | "
            f"{_ms(lat['p90'])} | {_ms(lat['p99'])} | {_ms(ttft['p50']) if ttft else 'n/a'} | "
            f"{s['throughput_rps']:.2f} | {s['output_tok_s']:.0f} | {busy_txt} | {_batch_text(s)} |")
    return out


def cpu_table(rows: list[dict]) -> list[str]:
    have = [r for r in rows if "cpu" in r]
    if not have:
        return []
    groups = [g for g in STAGE_ORDER if any(g in r["cpu"]["cpu_s"] for r in have)]
    out = ["| mode | kind | load | wall s | " + " | ".join(groups) + " | other processes | servers: CPU ms/req → req/s bound |",
           "|---|---|---|---|" + "---|" * len(groups) + "---|---|"]
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
        out.append(f"| {r['mode']} | {_kind(r)} | {r['load']} | {c['wall_s']:.1f} | " + " | ".join(cells) + " |")
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
    out = ["| mode | kind | load | preprocess wait / run | inference wait / run (batch wait + engine) | postprocess wait / "
           "run | rest: API, chord collect, result, HTTP (≈) | end-to-end p50 |", "|---|---|---|---|---|---|---|---|"]
    for r in have:
        st, e2e = r["summary"]["stage_p50_s"], r["summary"]["latency_s"]["p50"]
        cells, total = [], 0.0
        for stage in ("preprocess", "inference", "postprocess"):
            w, run = st.get(stage, {}).get("queue_wait_s", 0.0), st.get(stage, {}).get("run_s", 0.0)
            total += w + run
            cells.append(f"{_ms(w)} / {_ms(run)}")
        out.append(f"| {r['mode']} | {_kind(r)} | {r['load']} | " + " | ".join(cells)
                   + f" | {_ms(max(0.0, e2e - total))} | {_ms(e2e)} |")
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
    """One line per target; a ratio with a bootstrap interval shows it, and a verdict the
    interval does not settle (it holds the bound) says "within noise"."""
    out = ["| target | wanted | measured (95% CI) | met | how |", "|---|---|---|---|---|"]
    for t in targets:
        v = "n/a" if t["value"] is None else f"{t['value']:.2f}"
        if t.get("ci"):
            v += f" ({t['ci'][0]:.2f}-{t['ci'][1]:.2f})"
        met = ("yes" if t["met"] else "**no**") + (", within noise" if t.get("noise") else "")
        out.append(f"| {t['name']} | {t['target']} | {v} | {met} | {t['detail']} |")
    return out


def _header(result: dict) -> list[str]:
    meta = result["meta"]
    lines = [f"# llmpipe bench: {meta['started']}", "", f"Command: `{meta['command']}`", "",
             f"Machine: {meta['machine']}", "", "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
             "", f"Duration: {meta['duration_s']:.0f} s. Load average before / after: {meta['loadavg_start']} / "
             f"{meta['loadavg_end']} (other processes share this machine; see the 'other processes' CPU column).", ""]
    if result.get("plots"):
        lines += [f"Plots: {result['plots']}", ""]
    if result["targets"]:
        lines += ["## Targets (ratios from this run)", "", *targets_table(result["targets"]), ""]
    return lines


def _vllm_sections(rows: list[dict], targets: list[dict]) -> list[str]:
    ct = comparison_table(rows)
    if not ct:
        return []
    lines = ["Against `vllm serve` (as typed: vLLM's own defaults) and `vllm serve` matched (the pipeline's engine "
             "arguments: the same engine, so what differs is the pipeline):", "", *ct, ""]
    mt = misses(rows, targets)
    if mt:
        lines += ["Where the time goes, for each missed target (the pipeline's per-stage p50s from the job API, CPU ms per "
                  "request by process group; `vllm serve`'s beside):", "", *mt]
    return lines


def _engine_section(plan: dict, rows: list[dict], targets: list[dict], plots: dict[str, list[str]]) -> list[str]:
    key = plan["engine"]
    lines = [f"## {plan['label']}", "", f"Engine `{key}`. {plan['settings_text']}", ""]
    lines += [f"- {n}" for n in plan["notes"]] + ([""] if plan["notes"] else [])
    lines += results_table(rows) + [""]
    lines += _vllm_sections(rows, targets) if key == "real" else []
    lines += ["CPU per stage, as % of one core over the load point (and CPU ms per request); the last column is "
              "the serving processes' CPU per request and the req/s that all cores could sustain at that cost:",
              ""] + cpu_table(rows) + [""]
    for title, table in (("Where the time goes (p50 of the server's per-stage timings, ms):", breakdown_table(rows)),
                         ("Redis traffic (INFO commandstats deltas over the load point):", redis_table(rows))):
        if table:
            lines += [title, "", *table, ""]
    tt = trace_table(rows)
    if tt:
        lines += tt + [""]
    for p in plots.get(key, []):
        lines += [f"![{p}]({p})", ""]
    return lines


DEFINITIONS = (
    "Latency: client-observed, from sending the request to having the whole result. Closed loop: the first "
    "`concurrency` requests (the initial burst) and, when at least 8 remain, the last `concurrency` (sent "
    "while the load drains) are left out ('measured' counts the rest). Throughput, closed loop: concurrency / "
    "mean latency of the measured requests (Little's law; no think time), which is robust to completions "
    "that come in bursts of a batch; open loop: completions / time. Output tok/s: throughput x mean output "
    "tokens. Engine busy: share of the steady window (first measured request sent to last request sent) in "
    "which the engine had work: the union of per-request engine intervals (stage timings + engine_time_s) "
    "where the server reports them (approximate: a batch's interval is taken per request, from when its "
    "Celery task returned), else '(client)': the union of in-flight requests, an upper bound. Kind: the job API "
    "(jobs), or POST /v1/completions or /v1/chat/completions, streamed (-stream) or not. TTFT: only where the "
    "client streams; n/a otherwise. 95% CI of a target's ratio: a percentile bootstrap over the two points' "
    "measured requests, each side resampled on its own; 'within noise' where it holds the bound. It takes the "
    "requests as independent, as they are one at a time; in a closed loop's waves they are not, and the interval "
    "comes out narrower than the spread between runs.")


def markdown(result: dict, plots: dict[str, list[str]]) -> str:
    lines = _header(result)
    for plan in result["plans"]:
        lines += _engine_section(plan, _engine_rows(result["rows"], plan["engine"]), result["targets"], plots)
    lines += [DEFINITIONS, ""]
    return "\n".join(lines)


def write_all(result: dict, out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    why = missing()
    if why:
        result["plots"] = why
    made = {} if why else plots(result, out)
    (out / "results.json").write_text(json.dumps(result, separators=(",", ":"), default=str))
    (out / "report.md").write_text(markdown(result, made))
    return {"json": out / "results.json", "markdown": out / "report.md",
            **{p: out / p for ps in made.values() for p in ps}}
