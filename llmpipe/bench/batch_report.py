"""The Batch API benchmark's targets and its report (batch.md): the figures side by side, and
where the slowest interactive requests' time went (llmpipe/bench/batch.py runs them)."""

from __future__ import annotations

TARGETS = {"throughput_ratio": 0.9, "ttft_ratio": 1.25}


def _f(x, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def markdown(res: dict) -> str:
    o = res["options"]
    lines = [f"# Batch API: {o['lines']} lines, {o['prompt_tokens']}-token prompts, max_tokens {o['max_tokens']}",
             "", f"{res['meta']['machine']}; {res['meta']['started']}; model {res['model_path']}", ""]
    if "throughput" in res:
        lines += _throughput_md(res["throughput"])
    if "interactive" in res:
        lines += _interactive_md(res["interactive"])
    if "crash" in res:
        c = res["crash"]
        lines += [(f"Crashes ({c['lines']} lines; kill -9 of inference at 1/5, of the API at 1/2): batch "
                   f"{c['status']}, {c['rows']} rows, {c['missing']} missing, {c['duplicates']} duplicated; "
                   f"exactly once: {c['exactly_once']}"), ""]
    return "\n".join(lines)


def _throughput_md(t: dict) -> list[str]:
    lp, rb = t["llmpipe"], t["run_batch"]
    return ["| server | seconds | output tok/s | lines ok |", "|---|---|---|---|",
            f"| llmpipe /v1/batches | {_f(lp['seconds'])} | {_f(lp['tok_s'])} | {lp['ok']}/{lp['lines']} |",
            (f"| vllm run_batch | {_f(rb['seconds'])} | {_f(rb['tok_s'])} ({_f(rb['tok_s_after_startup'])} over its "
             f"{_f(rb.get('batch_seconds'))} s batch, after its {_f(rb['startup_seconds'])} s start-up) | "
             f"{rb['ok']}/{rb['lines']} |"), "",
            (f"llmpipe / run_batch: {_f(t['ratio'], '{:.2f}')}x (its batch alone), "
             f"{_f(t['ratio_whole_run'], '{:.2f}')}x (whole run); target >= {TARGETS['throughput_ratio']}x"), ""]


def _interactive_md(i: dict) -> list[str]:
    rows = [f"| {k} | {_f(i[k]['p50'], '{:.3f}')} | {_f(i[k]['p99'], '{:.3f}')} | {i[k]['ok']}/{i[k]['n']} |"
            for k in ("idle", "draining")]
    return ["| interactive TTFT (s) | p50 | p99 | ok |", "|---|---|---|---|", *rows, "",
            (f"draining / idle: p50 {_f(i['ratio']['p50'], '{:.2f}')}x, p99 {_f(i['ratio']['p99'], '{:.2f}')}x; "
             f"target <= {TARGETS['ttft_ratio']}x (the batch still draining at the end: "
             f"{i['batch_still_draining_at_end']})"), "", *_slowest_md(i), ""]


def _slowest_md(i: dict, k: int = 3) -> list[str]:
    """Each phase's ``k`` slowest requests: which one (the n-th sent) and their stage timings."""
    lines = []
    for phase in ("idle", "draining"):
        reqs = [(n, r) for n, r in enumerate(i[phase].get("requests", [])) if r["ttft_s"] is not None]
        for n, r in sorted(reqs, key=lambda nr: -nr[1]["ttft_s"])[:k]:
            st = ", ".join(f"{s} wait {w * 1000:.0f} run {x * 1000:.0f} ms" for s, (w, x) in (r["stages"] or {}).items()
                           if s in ("preprocess", "inference"))
            lines.append(f"- {phase}, request {n} of the phase: TTFT {r['ttft_s']:.3f} s; {st or 'no timings'}")
    return lines
