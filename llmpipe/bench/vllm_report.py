"""The real engine's part of report.md: each pipeline mode against `vllm serve` as typed and
against `vllm serve` on the pipeline's own engine arguments, request kind by kind; and, for
every missed target, where the pipeline's time and CPU went (the job API's per-stage
timings, a streamed request's time to first token by part, the CPU per process group)
beside `vllm serve`'s."""

from __future__ import annotations

from llmpipe.bench.stats import TTFT_PARTS
from llmpipe.bench.targets import VLLM_SERVE

MATCHED = "vllm-serve-matched"
STAGES = ("preprocess", "inference", "postprocess")


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1000:.0f}"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def _row(rows: list[dict], mode: str, kind: str, load: str) -> dict | None:
    hit = [r for r in rows if r["engine"] == "real" and r["mode"] == mode and r.get("kind", "jobs") == kind
           and r["load"] == load and "summary" in r]
    return hit[-1] if hit else None


def _ttft(r: dict | None) -> float | None:
    return ((r or {}).get("summary", {}).get("ttft_s") or {}).get("p50")


def _tok(r: dict | None) -> float | None:
    return (r or {}).get("summary", {}).get("output_tok_s")


def comparison_table(rows: list[dict]) -> list[str]:
    """Per pipeline mode, kind and load that `vllm serve` took: output tok/s and TTFT p50 of
    the pipeline, `vllm serve` as typed and `vllm serve` matched, with the ratios."""
    real = [r for r in rows if r["engine"] == "real"]
    modes = list(dict.fromkeys(r["mode"] for r in real if r["mode"].startswith("pipeline")))
    points = list(dict.fromkeys((r.get("kind", "jobs"), r["load"]) for r in real if r["mode"] == VLLM_SERVE))
    if not modes or not points:
        return []
    out = ["| pipeline mode | kind | load | output tok/s: pipeline / vllm serve / matched | vs vllm serve | vs matched "
           "| TTFT p50 ms: pipeline / vllm serve / matched | vs vllm serve | vs matched |",
           "|---|---|---|---|---|---|---|---|---|"]
    for mode in modes:
        for kind, load in points:
            p, v, m = (_row(rows, x, kind, load) for x in (mode, VLLM_SERVE, MATCHED))
            if p is None:
                continue
            toks = " / ".join("n/a" if t is None else f"{t:.1f}" for t in (_tok(p), _tok(v), _tok(m)))
            ttfts = " / ".join(_ms(_ttft(x)) for x in (p, v, m))
            out.append(f"| {mode} | {kind} | {load} | {toks} | {_ratio(_tok(p), _tok(v))} | {_ratio(_tok(p), _tok(m))} | "
                       f"{ttfts} | {_ratio(_ttft(p), _ttft(v))} | {_ratio(_ttft(p), _ttft(m))} |")
    return out


def _stages(r: dict) -> str:
    st, s = r["summary"].get("stage_p50_s") or {}, r["summary"]
    if not st:
        return "no per-stage timings (the job API did not answer for these requests)"
    parts, total = [], 0.0
    for stage in STAGES:
        w, run = st.get(stage, {}).get("queue_wait_s", 0.0), st.get(stage, {}).get("run_s", 0.0)
        total += w + run
        parts.append(f"{stage} wait {_ms(w)} / run {_ms(run)}")
    e2e = s["latency_s"]["p50"]
    engine = (s.get("engine_time_s") or {}).get("p50")
    return (", ".join(parts) + f"; the rest (API, chord collect, result, HTTP) ≈ {_ms(max(0.0, e2e - total))}; "
            f"engine time {_ms(engine)}; end-to-end {_ms(e2e)}")


def _ttft_parts(r: dict) -> str | None:
    """The TTFT's parts (llmpipe/bench/stats.py ttft_parts), p50 each, where they were read."""
    parts = r["summary"].get("ttft_parts_p50_s")
    if not parts:
        return None
    return ", ".join(f"{TTFT_PARTS[k]} {v * 1000:.1f}" for k, v in parts.items())


def _cpu(r: dict) -> str:
    c = r.get("cpu")
    if not c:
        return "not sampled"
    n = max(1, r["requests"])
    groups = ", ".join(f"{g} {v / n * 1000:.0f}" for g, v in c["cpu_s"].items() if g != "loadgen")
    serving = sum(v for g, v in c["cpu_s"].items() if g != "loadgen") / n * 1000
    return (f"{groups} (serving processes {serving:.0f} in all); load generator "
            f"{c['cpu_s'].get('loadgen', 0.0) / n * 1000:.0f}; other processes {c['other_cpu_s'] / c['wall_s'] * 100:.0f}% "
            f"of a core")


def _missed(t: dict) -> str:
    what = t["name"].rsplit(": ", 1)[-1].removeprefix(f"{t['mode']} ")
    return f"{what} {'n/a' if t['value'] is None else format(t['value'], '.2f')} (want {t['target']})"


def misses(rows: list[dict], targets: list[dict]) -> list[str]:
    """For each (pipeline mode, kind, load) with a missed target: the pipeline's per-stage
    p50s and CPU ms per request by process group, and `vllm serve`'s, in the same run."""
    out: list[str] = []
    seen = dict.fromkeys((t["mode"], t["kind"], t["load"]) for t in targets if t.get("against") and t["met"] is False)
    for mode, kind, load in seen:
        p, v = _row(rows, mode, kind, load), _row(rows, VLLM_SERVE, kind, load)
        names = "; ".join(_missed(t) for t in targets
                          if (t.get("mode"), t.get("kind"), t.get("load")) == (mode, kind, load) and t["met"] is False)
        out += [f"**{mode}, {kind}, {load}** (missed: {names})", ""]
        if p is None or v is None:
            out += ["- a point failed; see the results table", ""]
            continue
        out += [f"- pipeline, p50 ms: {_stages(p)}; TTFT {_ms(_ttft(p))} (vllm serve: end-to-end "
                f"{_ms(v['summary']['latency_s']['p50'])}, TTFT {_ms(_ttft(v))})",
                *([f"- TTFT p50 by part, ms: {parts}"] if (parts := _ttft_parts(p)) else []),
                f"- CPU ms per request, pipeline: {_cpu(p)}",
                f"- CPU ms per request, vllm serve: {_cpu(v)}", ""]
    return out
