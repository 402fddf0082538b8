"""From the samples of one load point to its figures: latency percentiles, throughput,
engine busy fraction, batch sizes."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from types import SimpleNamespace

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


BOOTSTRAP_RESAMPLES = 2000
CI_LEVEL = 0.95


def ratio_ci(a: Sequence, b: Sequence, stat: Callable[[Sequence], float], *, resamples: int = BOOTSTRAP_RESAMPLES,
             level: float = CI_LEVEL, seed: int = 0) -> tuple[float, float] | None:
    """A percentile bootstrap interval of ``stat(a) / stat(b)``: each side resampled with
    replacement on its own, ``resamples`` times (seeded: a report reads the same twice).
    None when a side has fewer than 2 values. It treats the requests of a point as
    independent, which holds one at a time (c=1) and less so for the waves of a closed
    loop, where the interval comes out narrower than the run-to-run spread."""
    if len(a) < 2 or len(b) < 2:
        return None
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        sb = stat(rng.choices(b, k=len(b)))
        if sb:
            ratios.append(stat(rng.choices(a, k=len(a))) / sb)
    if len(ratios) < resamples // 2:
        return None
    tail = (1 - level) / 2 * 100
    return percentile(ratios, tail), percentile(ratios, 100 - tail)


def median(values: Sequence[float]) -> float:
    return percentile(list(values), 50)


def token_rate(pairs: Sequence[tuple[float, int]]) -> float:
    """Output tokens per second of a closed loop per client, from (latency, tokens) pairs:
    mean tokens / mean latency, as ``summarize`` computes ``output_tok_s`` (times the
    concurrency, which cancels in a ratio at the same load)."""
    lat = sum(p[0] for p in pairs)
    return sum(p[1] for p in pairs) / lat if lat else 0.0


def steady_of_row(row: dict) -> list[SimpleNamespace]:
    """The measured, successful requests of a result row (its ``samples`` lists, as the
    runner stores them), chosen as ``summarize`` chose them."""
    keys = ("i", "start", "latency_s", "ok", "ttft_s", "completion_tokens")
    samples = [SimpleNamespace(**dict(zip(keys, s[:6], strict=True))) for s in row.get("samples") or []]
    load = row.get("load") or ""
    concurrency = int(load[2:]) if load.startswith("c=") else None
    return [s for s in _steady(samples, row.get("warmup", 0), concurrency) if s.ok]


def _steady(samples: list[Sample], warmup: int, concurrency: int | None) -> list[Sample]:
    measured = [s for s in samples if s.i >= warmup] or samples
    if concurrency:
        last = max((s.i for s in samples), default=0)
        inner = [s for s in measured if s.i <= last - concurrency]
        if sum(s.ok for s in inner) >= 8:
            return inner
    return measured


def summarize(samples: list[Sample], warmup: int, concurrency: int | None = None) -> dict:
    """Figures of one load point.

    Closed loop (``concurrency`` clients): the first ``warmup`` requests (the initial
    burst) and the last ``concurrency`` ones (sent while the load drains) are left out when
    that leaves at least 8, else only the first ``warmup``. Throughput is Little's law for
    a closed loop without think time, concurrency / mean latency of those requests: robust
    to completions that come in bursts (a batch of 32 finishing at once), unlike a count
    over a window. Open loop: completions (of any request) between the first measured
    request's arrival and the last arrival, over that time.
    """
    steady = _steady(samples, warmup, concurrency)
    ok = [s for s in steady if s.ok]
    errors = [s for s in steady if not s.ok]
    lo = min((s.start for s in steady), default=0.0)
    hi = max((s.start for s in samples), default=lo)  # the last request sent
    if sum(s.ok and lo < s.end <= hi for s in samples) < 3:
        hi = max((s.end for s in samples if s.ok), default=lo)
    window = max(hi - lo, 1e-9)
    if concurrency and ok:
        rps = concurrency / (sum(s.latency_s for s in ok) / len(ok))
        how = "closed loop: concurrency / mean latency (Little's law)"
    else:  # completions of any request while arrivals went on, over that time
        rps = sum(s.ok and lo < s.end <= hi for s in samples) / window
        how = "open loop: completions between the first measured and the last arrival / that time"
    starts = sorted(s.start for s in steady)
    offered = (len(starts) - 1) / (starts[-1] - starts[0]) if len(starts) > 1 and starts[-1] > starts[0] else None
    ttft = [s.ttft_s for s in ok if s.ttft_s is not None]
    tokens = (sum(s.completion_tokens for s in ok) / len(ok)) if ok else None
    out: dict = {
        "requests": len(samples),
        "measured": len(steady),
        "ok": len(ok),
        "errors": len(errors),
        "first_error": errors[0].error if errors else None,
        "window_s": window,
        "window": [lo, lo + window],  # epoch seconds: the steady window the rates are over
        "latency_s": pcts([s.latency_s for s in ok]),
        "ttft_s": pcts(ttft) if ttft else None,
        "throughput_rps": rps,
        "throughput_method": how,
        "offered_rps": None if concurrency else offered,  # open loop: the arrival rate realized
        "output_tok_s": rps * tokens if ok else 0.0,
        "completion_tokens_mean": tokens,
    }
    out["engine_busy"] = _engine_busy(samples, lo, hi, window)
    out.update(_server_figures(ok))
    return out


def _engine_busy(samples: list[Sample], lo: float, hi: float, window: float) -> dict:
    with_engine = [s.engine_interval for s in samples if s.ok and s.engine_interval is not None]
    if with_engine:
        return {"fraction": union_length(with_engine, lo, hi) / window,
                "method": "server: union of per-request engine intervals (from timings + engine_time_s)"}
    return {"fraction": union_length([(s.start, s.end) for s in samples if s.ok], lo, hi) / window,
            "method": "client: union of request in-flight intervals (an upper bound)"}


def _server_figures(ok: list[Sample]) -> dict:
    """Overhead, engine time, per-stage p50s and batch sizes, where the server reports them."""
    out: dict = {}
    # End-to-end minus engine time, wherever the server reports engine time (the celery
    # floor reports 0 and no stage timings).
    timed = [s for s in ok if s.engine_time_s is not None]
    out["overhead_s"] = pcts([s.latency_s - s.engine_time_s for s in timed]) if timed else None
    out["engine_time_s"] = pcts([s.engine_time_s for s in timed]) if timed else None
    stages: dict[str, dict[str, float | None]] = {}
    for stage in ("preprocess", "inference", "postprocess"):
        for part in ("queue_wait_s", "run_s"):
            vals = [t[stage][part] for s in ok if (t := s.extra.get("timings")) and stage in t]
            if vals:
                stages.setdefault(stage, {})[part] = percentile(vals, 50)
    out["stage_p50_s"] = stages or None  # from the server's per-prompt timings
    parts = [p for s in ok if (p := ttft_parts(s)) is not None]
    out["ttft_parts_p50_s"] = {k: percentile([p[k] for p in parts], 50) for k in TTFT_PARTS} if parts else None
    sizes = Counter(s.batch_size for s in ok if s.batch_size)
    out["batch_sizes"] = {str(k): v for k, v in sorted(sizes.items())} or None
    if sizes:
        n = sum(sizes.values())
        out["batch_size_mean"] = sum(k * v for k, v in sizes.items()) / n  # per request
    return out


# A streamed request's time to first token, cut where the server stamps it (ttft_parts):
# each part's key, in order, and its name in reports.
TTFT_PARTS = {"to_job_s": "to the job (API)", "preprocess_s": "preprocess", "inference_queue_s": "inference queue",
              "inference_to_first_token_s": "inference start to the first token", "to_client_s": "to the client"}


def ttft_parts(s: Sample) -> dict[str, float] | None:
    """``s``'s TTFT in TTFT_PARTS, which add up to it: the client's send to the job's record
    (the API), preprocess (its queue and run), the inference queue, the inference stage's
    start to the engine's first token (the batcher, then the prefill), and that token's way to
    the client (the token stream, the API, HTTP). Server and client stamp epoch time on one
    machine, as the bench runs them. None without a TTFT or the job's figures."""
    t, created, first = s.extra.get("timings") or {}, s.extra.get("created_at"), s.extra.get("first_token_at")
    if s.ttft_s is None or created is None or first is None or not {"preprocess", "inference"} <= t.keys():
        return None
    pre = t["preprocess"]["queue_wait_s"] + t["preprocess"]["run_s"]
    queue = t["inference"]["queue_wait_s"]
    return dict(zip(TTFT_PARTS, (created - s.start, pre, queue, first - (created + pre + queue),
                                 s.start + s.ttft_s - first), strict=True))


def cdf_points(samples: list[Sample], warmup: int, concurrency: int | None = None) -> list[float]:
    """Sorted latencies (seconds) of the measured, successful requests, for the CDF plot."""
    last = max((s.i for s in samples), default=0)
    measured = [s for s in samples if s.i >= warmup] or samples
    inner = [s for s in measured if concurrency and s.i <= last - concurrency and s.ok]
    return sorted(s.latency_s for s in (inner if len(inner) >= 8 else measured) if s.ok)
