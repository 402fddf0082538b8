"""From the samples of one load point to its figures: latency percentiles, throughput,
engine busy fraction, batch sizes."""

from __future__ import annotations

import math
from collections import Counter

from llmpipe.bench.loadgen import Sample


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def pcts(values: list[float]) -> dict[str, float | None]:
    return {f"p{q}": percentile(values, q) for q in (50, 90, 99)} | {"mean": sum(values) / len(values) if values else None}


def union_length(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Total length of the union of ``intervals`` clipped to [lo, hi]."""
    total, cur_a, cur_b = 0.0, None, None
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals):
        if b <= a:
            continue
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


def summarize(samples: list[Sample], warmup: int) -> dict:
    """Figures of one load point.

    The first ``warmup`` requests (in issue order: the initial burst of a closed loop) are
    left out of the latency figures. Throughput is the rate of completions in the window
    from the first measured request's start to the last request's start (the steady state,
    before the load drains).
    """
    measured = [s for s in samples if s.i >= warmup] or samples
    ok = [s for s in measured if s.ok]
    errors = [s for s in measured if not s.ok]
    lo = min((s.start for s in measured), default=0.0)
    # Steady state: up to the last request sent (after it the load drains); a window
    # without completions falls back to the last completion.
    hi = max((s.start for s in samples), default=lo)
    if not any(s.ok and lo < s.end <= hi for s in samples):
        hi = max((s.end for s in samples if s.ok), default=lo)
    window = max(hi - lo, 1e-9)
    done = [s for s in samples if s.ok and lo < s.end <= hi]
    lat = [s.latency_s for s in ok]
    ttft = [s.ttft_s for s in ok if s.ttft_s is not None]
    out: dict = {
        "requests": len(samples),
        "measured": len(measured),
        "ok": len(ok),
        "errors": len(errors),
        "first_error": errors[0].error if errors else None,
        "window_s": window,
        "latency_s": pcts(lat),
        "ttft_s": pcts(ttft) if ttft else None,
        "throughput_rps": len(done) / window,
        "output_tok_s": sum(s.completion_tokens for s in done) / window,
        "completion_tokens_mean": (sum(s.completion_tokens for s in ok) / len(ok)) if ok else None,
    }
    with_engine = [s for s in samples if s.ok and s.engine_interval is not None]
    if with_engine:
        intervals = [s.engine_interval for s in with_engine]
        out["engine_busy"] = {"fraction": union_length(intervals, lo, hi) / window,
                              "method": "server: union of per-request engine intervals (from timings + engine_time_s)"}
        overhead = [s.latency_s - s.engine_time_s for s in ok if s.engine_time_s is not None]
        out["overhead_s"] = pcts(overhead)
        out["engine_time_s"] = pcts([s.engine_time_s for s in ok if s.engine_time_s is not None])
    else:
        intervals = [(s.start, s.end) for s in samples if s.ok]
        out["engine_busy"] = {"fraction": union_length(intervals, lo, hi) / window,
                              "method": "client: union of request in-flight intervals (an upper bound)"}
        out["overhead_s"] = None
        out["engine_time_s"] = None
    stages: dict[str, dict[str, float | None]] = {}
    for stage in ("preprocess", "inference", "postprocess"):
        for part in ("queue_wait_s", "run_s"):
            vals = [t[stage][part] for s in ok if (t := s.extra.get("timings")) and stage in t]
            if vals:
                stages.setdefault(stage, {})[part] = percentile(vals, 50)
    out["stage_p50_s"] = stages or None  # from the server's per-prompt timings
    sizes = Counter(s.batch_size for s in ok if s.batch_size)
    out["batch_sizes"] = {str(k): v for k, v in sorted(sizes.items())} or None
    if sizes:
        n = sum(sizes.values())
        out["batch_size_mean"] = sum(k * v for k, v in sizes.items()) / n  # per request
    return out


def cdf_points(samples: list[Sample], warmup: int) -> list[float]:
    """Sorted latencies (seconds) of the measured, successful requests, for the CDF plot."""
    measured = [s for s in samples if s.i >= warmup] or samples
    return sorted(s.latency_s for s in measured if s.ok)
