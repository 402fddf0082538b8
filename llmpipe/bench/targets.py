"""The issue's targets, as ratios of figures measured in the same run."""

from __future__ import annotations

from llmpipe.bench.kinds import JOBS, STREAMING
from llmpipe.bench.stats import median, ratio_ci, steady_of_row, token_rate

# Real vLLM: the pipeline (as `make up` ships it: pipeline-window50, in the default run)
# against `vllm serve MODEL` as a user types it, at every load and in every request kind.
VLLM_SERVE = "vllm-serve"
TOK_S_RATIO = 0.95  # output tokens/s, pipeline / vllm serve, at least
TTFT_RATIO = 1.1  # TTFT p50 (streaming kinds), pipeline / vllm serve, at most


def _find(rows: list[dict], engine: str, mode: str, load: str | None = None, kind: str | None = None) -> dict | None:
    ok = [r for r in rows if r["engine"] == engine and r["mode"] == mode and "summary" in r
          and (load is None or r["load"] == load) and (kind is None or r.get("kind", JOBS) == kind)]
    return ok[-1] if ok else None


def _loads(rows: list[dict], engine: str, mode: str) -> list[str]:
    return [r["load"] for r in rows if r["engine"] == engine and r["mode"] == mode and "summary" in r]


def _top_common_load(rows: list[dict], engine: str, a: str, b: str) -> str | None:
    common = [ld for ld in _loads(rows, engine, a) if ld in _loads(rows, engine, b)]
    return common[-1] if common else None


def _p(row: dict, q: str = "p50", key: str = "latency_s") -> float | None:
    v = row["summary"].get(key)
    return v.get(q) if v else None


def _t(name: str, target: str, value: float | None, ok: bool | None, detail: str, **where) -> dict:
    """``where``: the rows a target compares (engine, mode, kind, load, against), for the report."""
    return {"name": name, "target": target, "value": value, "met": ok, "detail": detail, **where}


def _with_ci(t: dict, ci: tuple[float, float] | None, bound: float) -> dict:
    """The ratio's bootstrap interval (llmpipe/bench/stats.py ratio_ci), and whether it holds
    ``bound``: then this run cannot tell a met target from a missed one (``noise``)."""
    if ci is not None:
        t["ci"] = [ci[0], ci[1]]
        t["noise"] = ci[0] <= bound <= ci[1]
    return t


def evaluate(rows: list[dict], theoretical: dict[str, float]) -> list[dict]:
    """``theoretical``: load label -> the simulated engine's capacity (req/s) at that load."""
    out: list[dict] = []
    # Simulated GPU: batching against serial at the highest common concurrency (64 by default).
    load = _top_common_load(rows, "simulated", "pipeline-window50", "serial")
    if load:
        b, s = _find(rows, "simulated", "pipeline-window50", load), _find(rows, "simulated", "serial", load)
        rb, rs = b["summary"]["throughput_rps"], s["summary"]["throughput_rps"]
        ratio = rb / rs if rs else None
        out.append(_t("simulated: batching throughput vs serial", ">= 2.5x", ratio, ratio is not None and ratio >= 2.5,
                      f"{load}: pipeline-window50 {rb:.2f} req/s, serial {rs:.2f} req/s"))
        cap = theoretical.get(load) if load.startswith("c=") else None  # open loop: bounded by the offered rate
        if cap:
            f = rb / cap
            out.append(_t("simulated: batching throughput vs the engine's theoretical capacity", ">= 0.90", f, f >= 0.9,
                          f"{load}: {rb:.2f} req/s of {cap:.2f} req/s (full batches back to back)"))
        pb, ps = _p(b, "p99"), _p(s, "p99")
        if pb and ps:
            out.append(_t("simulated: batching p99 vs serial p99", "<= 0.3x", pb / ps, pb / ps <= 0.3,
                          f"{load}: {pb * 1000:.0f} ms vs {ps * 1000:.0f} ms"))
    # No-op engine: overhead at idle, capacity, and the window at idle.
    idle = _find(rows, "noop", "pipeline-window50", "c=1")
    if idle and idle["summary"].get("overhead_s"):
        ov = idle["summary"]["overhead_s"]["p50"]
        out.append(_t("noop: orchestration overhead at idle (p50, end-to-end minus engine time, API included)",
                      "<= 10 ms", ov * 1000, ov <= 0.010, "pipeline-window50, one client"))
    caps = [(r["summary"]["throughput_rps"], r["mode"], r["load"]) for r in rows
            if r["engine"] == "noop" and r["mode"].startswith("pipeline") and "summary" in r]
    if caps:
        best = max(caps)
        out.append(_t("noop: pipeline capacity", ">= 400 req/s", best[0], best[0] >= 400, f"best: {best[1]} at {best[2]}"))
    w0 = _find(rows, "noop", "pipeline-window0", "c=1")
    if idle and w0:
        # The window acts inside the inference stage (its run time is batch wait + engine),
        # so compare that; the end-to-end p50s of two separate pipelines differ by noise.
        inf = [(r["summary"].get("stage_p50_s") or {}).get("inference", {}).get("run_s") for r in (idle, w0)]
        e2e = f"end-to-end p50 {_p(idle) * 1000:.1f} vs {_p(w0) * 1000:.1f} ms"
        if None not in inf:
            d = (inf[0] - inf[1]) * 1000
            detail = f"inference stage run (batch wait + engine) p50 {inf[0] * 1000:.1f} vs {inf[1] * 1000:.1f} ms; {e2e}"
        else:
            d, detail = (_p(idle) - _p(w0)) * 1000, e2e
        out.append(_t("noop: idle latency added by the 50 ms window (p50, window 50 minus window 0, one client)",
                      "<= 5 ms (0, not 50)", d, d <= 5.0, detail))
    out += floor_targets(rows)
    out += real_targets(rows)
    return out


def servers_cpu_ms(row: dict) -> float | None:
    """CPU ms per request of the serving processes (API, workers, Redis; not the load generator)."""
    c = row.get("cpu")
    if not c:
        return None
    return sum(v for g, v in c["cpu_s"].items() if g != "loadgen") / max(1, row["requests"]) * 1000


def floor_targets(rows: list[dict], mode: str = "pipeline-window50", floor: str = "celery-floor") -> list[dict]:
    """Issue 11: the pipeline's per-request cost against the celery floor's, same run."""
    out: list[dict] = []
    for load in ("c=64", "c=1"):
        p, f = _find(rows, "noop", mode, load), _find(rows, "noop", floor, load)
        if p and f and load == "c=64":
            rp, rf = p["summary"]["throughput_rps"], f["summary"]["throughput_rps"]
            out.append(_t("noop: capacity at c=64 vs the celery floor", ">= 0.8x", rp / rf if rf else None,
                          bool(rf) and rp / rf >= 0.8, f"{mode} {rp:.1f} req/s, floor {rf:.1f} req/s"))
            cp, cf = servers_cpu_ms(p), servers_cpu_ms(f)
            if cp and cf:
                out.append(_t("noop: serving CPU per request vs the celery floor (c=64)", "<= 1.3x", cp / cf,
                              cp / cf <= 1.3, f"{cp:.1f} vs {cf:.1f} ms/request (API, workers, Redis)"))
        if p and f and load == "c=1" and p["summary"].get("overhead_s") and f["summary"].get("overhead_s"):
            op, of = p["summary"]["overhead_s"]["p50"] * 1000, f["summary"]["overhead_s"]["p50"] * 1000
            out.append(_t("noop: idle overhead (p50, end-to-end minus engine time) minus the floor's", "<= 3 ms and <= 10 ms "
                          "in all", op - of, op - of <= 3.0 and op <= 10.0, f"{op:.1f} ms vs floor {of:.1f} ms"))
    tp = next((r["redis_trace"] for r in rows if r["mode"] == mode and r.get("redis_trace")), None)
    tf = next((r["redis_trace"] for r in rows if r["mode"] == floor and r.get("redis_trace")), None)
    if tp and tf:
        d = tp["total_per_request"] - tf["total_per_request"]
        out.append(_t("noop: Redis commands per single-prompt request minus the floor's", "<= 15", d, d <= 15,
                      f"{tp['total_per_request']:g} vs {tf['total_per_request']:g} (MONITOR, idle, background subtracted)"))
    p = _find(rows, "noop", mode, "c=1")
    lag = (p or {}).get("stream_end") or {}
    if lag.get("p50_ms") is not None:
        out.append(_t("noop: a stream's end after its job completed (p50)", "<= 5 ms", lag["p50_ms"], lag["p50_ms"] <= 5.0,
                      f"{lag['n']} streaming requests one at a time; p90 {lag['p90_ms']:.1f} ms; client's [DONE] "
                      "minus the job record's terminal write"))
    return out


def _any(rows: list[dict], mode: str, load: str, kind: str) -> dict | None:
    hit = [r for r in rows if r["engine"] == "real" and r["mode"] == mode and r["load"] == load
           and r.get("kind", JOBS) == kind]
    return hit[-1] if hit else None


def real_targets(rows: list[dict], modes: tuple[str, ...] | None = None) -> list[dict]:
    """Per request kind and load that `vllm serve` took: each pipeline mode's (``modes``;
    default: every one in the rows) output tokens/s >= 0.95x and, where it streams, TTFT p50
    <= 1.1x `vllm serve`'s. A point that failed on either side is a missed target. Each
    ratio carries its 95 % bootstrap interval (``ci``) over the point's measured requests,
    and ``noise`` where the interval holds the bound."""
    if modes is None:
        modes = tuple(dict.fromkeys(r["mode"] for r in rows if r["engine"] == "real" and r["mode"].startswith("pipeline")))
    out: list[dict] = []
    for mode in modes:
        for v in [r for r in rows if r["engine"] == "real" and r["mode"] == VLLM_SERVE]:
            kind, load = v.get("kind", JOBS), v["load"]
            p = _any(rows, mode, load, kind)
            if p is None:
                continue
            where = {"engine": "real", "mode": mode, "kind": kind, "load": load, "against": VLLM_SERVE}
            name = f"real vLLM, {kind}, {load}: {mode}"
            failed = next((f"{r['mode']} failed: {str(r.get('error', ''))[:120]}" for r in (p, v) if "summary" not in r), None)
            if failed:
                out.append(_t(f"{name} output tok/s vs vllm serve", f">= {TOK_S_RATIO}x", None, False, failed, **where))
                continue
            sp, sv = steady_of_row(p), steady_of_row(v)
            tp, tv = p["summary"]["output_tok_s"], v["summary"]["output_tok_s"]
            ratio = tp / tv if tv else None
            ci = ratio_ci([(s.latency_s, s.completion_tokens) for s in sp],
                          [(s.latency_s, s.completion_tokens) for s in sv], token_rate)
            out.append(_with_ci(_t(f"{name} output tok/s vs vllm serve", f">= {TOK_S_RATIO}x", ratio,
                                   ratio is not None and ratio >= TOK_S_RATIO, f"{tp:.1f} vs {tv:.1f} tok/s", **where),
                                ci, TOK_S_RATIO))
            fp, fv = _p(p, "p50", "ttft_s"), _p(v, "p50", "ttft_s")
            if kind in STREAMING:
                ok = bool(fp and fv) and fp / fv <= TTFT_RATIO
                ci = ratio_ci([s.ttft_s for s in sp if s.ttft_s is not None],
                              [s.ttft_s for s in sv if s.ttft_s is not None], median)
                out.append(_with_ci(_t(f"{name} TTFT p50 vs vllm serve", f"<= {TTFT_RATIO}x",
                                       fp / fv if fp and fv else None, ok,
                                       f"{fp * 1000:.0f} vs {fv * 1000:.0f} ms" if fp and fv else "no TTFT measured",
                                       **where), ci, TTFT_RATIO))
    return out
