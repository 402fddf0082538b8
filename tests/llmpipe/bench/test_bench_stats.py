"""The bench's arithmetic, without servers."""

from __future__ import annotations

import pytest

from llmpipe.bench.loadgen import Sample, engine_interval
from llmpipe.bench.stats import (
    median,
    percentile,
    ratio_ci,
    steady_of_row,
    summarize,
    token_rate,
    ttft_parts,
    union_length,
)


def test_percentile_interpolates_like_numpy():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)


def test_union_length_merges_and_clips():
    assert union_length([], 0, 10) == 0
    assert union_length([(1, 3), (2, 4), (6, 7)], 0, 10) == pytest.approx(4.0)
    assert union_length([(-5, 2), (9, 20)], 0, 10) == pytest.approx(3.0)
    assert union_length([(1, 2), (1, 2)], 0, 10) == pytest.approx(1.0)


def test_engine_interval_from_stage_timings():
    t = {"preprocess": {"queue_wait_s": 0.1, "run_s": 0.2}, "inference": {"queue_wait_s": 0.3, "run_s": 1.0}}
    a, b = engine_interval(100.0, t, 0.5)
    assert b == pytest.approx(101.6) and a == pytest.approx(101.1)
    assert engine_interval(100.0, {}, 0.5) is None


def _sample(i, start, lat, engine=None, batch=None):
    s = Sample(i=i, start=start, latency_s=lat, ok=True, completion_tokens=10, batch_size=batch)
    if engine:
        s.engine_time_s = engine[1] - engine[0]
        s.engine_interval = engine
    return s


def test_closed_loop_throughput_is_littles_law_on_the_steady_requests():
    # 2 clients; every request after the first takes 2 s: 1 request/s whatever the bursts.
    samples = [_sample(0, 0.0, 1.0), _sample(1, 0.0, 2.0)] + [_sample(k, k - 1.0, 2.0) for k in range(2, 10)]
    samples.append(Sample(i=10, start=9.5, latency_s=0.1, ok=False, error="boom"))
    s = summarize(samples, warmup=2, concurrency=2)
    # fewer than 8 left once the drain is cut too: only the initial burst is left out
    assert s["measured"] == 9 and s["ok"] == 8 and s["errors"] == 1 and s["first_error"] == "boom"
    assert s["latency_s"]["p50"] == pytest.approx(2.0)
    assert s["throughput_rps"] == pytest.approx(1.0)
    assert s["throughput_method"].startswith("closed loop")
    assert s["engine_busy"]["method"].startswith("client")
    assert s["ttft_s"] is None and s["batch_sizes"] is None
    # enough requests: the last `concurrency` (the drain, here faster) are left out as well
    more = [_sample(0, 0.0, 1.0), _sample(1, 0.0, 2.0)] + [_sample(k, k - 1.0, 2.0) for k in range(2, 20)]
    more += [_sample(20, 19.0, 0.5), _sample(21, 19.5, 0.5)]
    m = summarize(more, warmup=2, concurrency=2)
    assert m["measured"] == 18 and m["throughput_rps"] == pytest.approx(1.0)


def test_ratio_ci_brackets_the_ratio_and_tells_apart_what_differs():
    base = [0.100, 0.104, 0.097, 0.110, 0.093, 0.101, 0.099, 0.106]
    same = ratio_ci([x * 1.01 for x in base], base, median)
    assert same[0] < 1.01 < same[1] and same[0] < 1.0 < same[1]  # a 1 % shift is within this spread
    apart = ratio_ci([x * 1.5 for x in base], base, median)
    assert 1.3 < apart[0] <= 1.5 <= apart[1] < 1.7  # 1.5x is told apart
    assert ratio_ci([x * 1.5 for x in base], base, median) == apart  # seeded: a report reads the same twice
    assert ratio_ci([0.1], base, median) is None and ratio_ci(base, [0.1], median) is None
    # tokens per second from (latency, tokens): mean tokens over mean latency, as summarize's
    assert token_rate([(1.0, 32), (3.0, 32)]) == pytest.approx(16.0)
    lo, hi = ratio_ci([(2.0, 32)] * 5, [(1.0, 32)] * 5, token_rate)
    assert lo == pytest.approx(0.5) and hi == pytest.approx(0.5)


def test_steady_of_row_picks_what_summarize_measured():
    samples = [_sample(0, 0.0, 1.0), _sample(1, 0.0, 2.0)] + [_sample(k, k - 1.0, 2.0) for k in range(2, 20)]
    samples += [_sample(20, 19.0, 0.5), _sample(21, 19.5, 0.5)]
    row = {"load": "c=2", "warmup": 2,
           "samples": [[x.i, x.start, x.latency_s, x.ok, x.ttft_s, x.completion_tokens, x.batch_size, x.engine_time_s]
                       for x in samples]}
    steady = steady_of_row(row)
    assert [s.i for s in steady] == list(range(2, 20)) == list(range(2, 2 + summarize(samples, 2, 2)["measured"]))


def test_open_loop_throughput_counts_completions():
    samples = [_sample(k, 0.5 * k, 0.25) for k in range(10)]
    s = summarize(samples, warmup=1)
    # arrivals from t=0.5 to t=4.5; completions in between: 0.75, 1.25, ..., 4.25
    assert s["throughput_rps"] == pytest.approx(8 / 4.0)
    assert s["offered_rps"] == pytest.approx(2.0)


def test_summarize_uses_server_engine_intervals_and_batch_sizes():
    samples = [_sample(i, float(i), 1.0, engine=(i + 0.5, i + 0.75), batch=2) for i in range(4)]
    s = summarize(samples, warmup=0)
    assert s["engine_busy"]["method"].startswith("server")
    assert s["engine_busy"]["fraction"] == pytest.approx(1.0 / 4.0)
    assert s["batch_sizes"] == {"2": 4} and s["batch_size_mean"] == 2
    assert s["overhead_s"]["p50"] == pytest.approx(0.75)


def test_a_streamed_requests_ttft_splits_at_the_servers_stamps_into_parts_that_add_up():
    def streamed(i: int, ttft: float) -> Sample:
        s = Sample(i=i, start=100.0 + i, latency_s=0.5, ok=True, ttft_s=ttft)
        s.extra.update(created_at=s.start + 0.002, first_token_at=s.start + ttft - 0.003,
                       timings={"preprocess": {"queue_wait_s": 0.004, "run_s": 0.001},
                                "inference": {"queue_wait_s": 0.005, "run_s": 0.4}})
        return s

    parts = ttft_parts(streamed(0, 0.1))
    assert parts == pytest.approx({"to_job_s": 0.002, "preprocess_s": 0.005, "inference_queue_s": 0.005,
                                   "inference_to_first_token_s": 0.085, "to_client_s": 0.003})
    assert sum(parts.values()) == pytest.approx(0.1)
    answered = Sample(i=1, start=1.0, latency_s=0.5, ok=True)  # not streamed: no TTFT to split
    answered.extra.update(created_at=1.001, first_token_at=1.1, timings=streamed(0, 0.1).extra["timings"])
    assert ttft_parts(answered) is None
    s = summarize([streamed(i, 0.1 + i / 100) for i in range(5)], warmup=0)
    assert s["ttft_parts_p50_s"]["inference_to_first_token_s"] == pytest.approx(0.105)
    assert summarize([answered] * 3, warmup=0)["ttft_parts_p50_s"] is None


def test_redis_trace_classifies_commands_by_purpose():
    from llmpipe.bench.redis_trace import classify

    assert classify('"LPUSH" "preprocess" "{}"') == ("broker: task queues", "LPUSH")
    assert classify('"BRPOP" "inference" "inference\\x06\\x163" "1"') == ("broker: task queues", "BRPOP")
    assert classify('"ZADD" "unacked_index" "1" "x"')[0].startswith("broker: unacked")
    assert classify('"PUBLISH" "/0.celeryev/task.succeeded" "{}"')[0].startswith("worker events")
    assert classify('"SETEX" "celery-task-meta-abc" "86400" "{}"') == ("result backend: task results", "SETEX")
    assert classify('"EVALSHA" "deadbeef" "2" "llmpipe:job:abc" "x"') == ("llmpipe:job:*", "EVALSHA")
    assert classify('"MULTI"')[0].startswith("MULTI/EXEC")


def test_open_loop_sends_at_the_nominal_rate():
    import asyncio

    from llmpipe.bench.loadgen import run_load

    class Instant:
        protocol = "fake"

        async def request(self, http, s, prompt):
            s.ok = True

    samples = asyncio.run(run_load(Instant(), ["p"], requests=40, rate=200.0))
    starts = sorted(s.start for s in samples)
    assert len(samples) == 40 and all(s.ok for s in samples)
    assert (starts[-1] - starts[0]) == pytest.approx(39 / 200.0, rel=0.35)
