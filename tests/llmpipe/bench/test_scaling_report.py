"""The scaling report's per-point CPU shares: the load generator and the whole machine are
reported, so a point where the 2 cores were saturated shows as such (docs/benchmarks.md,
"Scaling across hosts")."""

from __future__ import annotations

from llmpipe.bench.scaling_report import analyze, markdown


def _row(workers: int, rps: float, cpu_s: dict, system_cpu_s: float, wall_s: float = 10.0) -> dict:
    return {"layout": "hosts-20ms", "workers": workers, "concurrency": 64, "requests": 100,
            "summary": {"throughput_rps": rps, "latency_s": {"p50": 1.0, "p99": 2.0}, "errors": 0},
            "cpu": {"wall_s": wall_s, "cores": 2, "cpu_s": cpu_s, "system_cpu_s": system_cpu_s,
                    "other_cpu_s": system_cpu_s - sum(cpu_s.values())},
            "per_worker": {f"inference-{i + 1}": {"mean_batch": 8.0} for i in range(workers)},
            "capacity_rps": rps, "latencies_s": [1.0]}


def test_machine_and_load_generator_shares_are_reported():
    rows = [_row(1, 1.0, {"api": 1.0, "loadgen": 1.0}, 4.0), _row(2, 2.0, {"api": 4.0, "loadgen": 2.0}, 20.0)]
    a = analyze(rows, "hosts-20ms", 8, [64], [], quick=False)
    one, two = a["scaling"]
    assert one["cpu_share"] == 1.0 / 20 and one["loadgen_cpu_share"] == 1.0 / 20
    assert one["other_cpu_share"] == 2.0 / 20 and one["machine_busy"] == 4.0 / 20
    assert two["machine_busy"] == 1.0 and two["speedup"] == 2.0
    md = markdown({"meta": {"started": "t", "command": "c", "machine": "m", "loadavg_start": "l",
                            "loadavg_end": "l", "duration_s": 1.0},
                   "conditions": "", "analysis": a, "rows": rows})
    assert "| load generator | other processes | machine busy |" in md
    # CPU use, load generator, other processes, machine busy: the shares above, in order.
    assert "| 5% | 5% | 10% | 20% |" in md and "| 20% | 10% | 70% | 100% |" in md
