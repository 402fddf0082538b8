"""The celery floor runs on the pipeline's worker settings, and the issue-11 figures are
ratios to the floor of the same run. No processes: argv and result shapes only."""

from __future__ import annotations

from benchmarks.cost.compare import figures, table
from llmpipe.bench.floor import QUEUES, app, floor_worker_argv
from llmpipe.bench.targets import floor_targets
from llmpipe.settings import Settings
from workers.launch import worker_argv


def test_floor_workers_run_with_the_pipelines_pool_concurrency_prefetch_and_events():
    for events in (True, False):
        s = Settings(task_events=events, cpu_workers=2, max_batch_size=32)
        for kind in QUEUES:
            floor = floor_worker_argv(kind, s, name="n")
            pipe = worker_argv(kind, s, name="n")
            assert floor[floor.index("-A") + 1] == "llmpipe.bench.floor"
            assert floor[floor.index("-Q") + 1] == kind
            for flag in ("-P", "-c", "--prefetch-multiplier"):
                assert floor[floor.index(flag) + 1] == pipe[pipe.index(flag) + 1], (kind, flag)
            assert ("-E" in floor) == ("-E" in pipe) == events


def test_floor_app_keeps_the_pipelines_reliability_and_serializer_settings():
    import celeryconfig

    for key in ("task_acks_late", "task_reject_on_worker_lost", "worker_prefetch_multiplier", "task_serializer",
                "accept_content", "broker_transport_options", "worker_send_task_events", "task_send_sent_event"):
        assert app.conf[key] == getattr(celeryconfig, key), key
    assert app.conf.imports == ()  # none of llmpipe's tasks or worker signals
    assert {t for t in app.tasks if t.startswith("floor.")} == {f"floor.{q}" for q in QUEUES}


def _row(mode, load, rps, p50_s, cpu_s, requests=100, trace=None, stream_end=None):
    row = {"engine": "noop", "mode": mode, "load": load, "requests": requests,
           "summary": {"throughput_rps": rps, "overhead_s": {"p50": p50_s}, "latency_s": {"p50": p50_s}},
           "cpu": {"cpu_s": {"api": cpu_s, "loadgen": 5.0}, "wall_s": 10.0, "other_cpu_s": 1.0}}
    if trace is not None:
        row["redis_trace"] = {"total_per_request": trace, "per_request": {"x": trace}}
    if stream_end is not None:
        row["stream_end"] = {"n": 20, "p50_ms": stream_end, "p90_ms": stream_end * 2}
    return row


def test_targets_and_table_are_ratios_to_the_floor_of_the_same_run():
    rows = [_row("celery-floor", "c=1", 40, 0.020, 2.0, trace=50),
            _row("celery-floor", "c=64", 100, 0.6, 2.0),
            _row("pipeline-window50", "c=1", 30, 0.0225, 2.0, trace=64, stream_end=3.0),
            _row("pipeline-window50", "c=64", 85, 0.7, 2.5)]
    got = {t["name"]: (round(t["value"], 3), t["met"]) for t in floor_targets(rows)}
    assert got == {
        "noop: capacity at c=64 vs the celery floor": (0.85, True),
        "noop: serving CPU per request vs the celery floor (c=64)": (1.25, True),
        "noop: idle overhead (p50, end-to-end minus engine time) minus the floor's": (2.5, False),  # 22.5 ms > 10
        "noop: Redis commands per single-prompt request minus the floor's": (14, True),
        "noop: a stream's end after its job completed (p50)": (3.0, True),
    }
    result = {"rows": rows, "meta": {"loadavg_start": "1 1 1", "loadavg_end": "2 2 2"}}
    assert figures(result, "pipeline-window50")["cpu_ms"] == 25.0  # loadgen left out
    lines = table({"run": result})
    assert "85.0 (0.85x)" in lines[-1] and "(+2.5)" in lines[-1] and "64 (+14.0)" in lines[-1]
