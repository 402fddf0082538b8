"""CI smoke run of ``llmpipe bench --quick``: the tool works end to end. No speed is asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

ROOT_KEYS = {"meta", "plans", "rows", "targets", "modes", "theoretical_capacity_rps"}
SUMMARY_KEYS = {"latency_s", "ttft_s", "throughput_rps", "output_tok_s", "engine_busy", "batch_sizes", "errors"}


@pytest.mark.timeout(900)
def test_bench_quick_writes_json_markdown_and_plots(tmp_path, tiny_model):
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "llmpipe.cli", "bench", "--quick", "--model", tiny_model, "--out", str(out)],
        capture_output=True, text=True, timeout=840,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    result = json.loads((out / "results.json").read_text())
    assert ROOT_KEYS <= result.keys()
    assert {"machine", "versions", "command", "started", "duration_s"} <= result["meta"].keys()
    seen = {(r["engine"], r["mode"]) for r in result["rows"]}
    assert {("noop", "pipeline-window50"), ("simulated", "serial"), ("simulated", "pipeline-window50"),
            ("real", "pipeline-window50")} <= seen
    # The real engine's pipeline through its OpenAI endpoints, in all four request kinds;
    # a TTFT where the answer streams.
    real = {r["kind"]: r for r in result["rows"] if r["engine"] == "real"}
    assert set(real) == {"completions-stream", "completions", "chat-stream", "chat"}
    for kind, row in real.items():
        assert (row["summary"]["ttft_s"] is not None) is kind.endswith("-stream")
        assert row["summary"]["completion_tokens_mean"] == 8  # --quick's max_tokens, ignore_eos
        assert row["summary"]["stage_p50_s"]  # the job API's timings, read back by job id
    for row in result["rows"]:
        assert "summary" in row, row.get("error")
        assert SUMMARY_KEYS <= row["summary"].keys()
        assert row["summary"]["ok"] > 0
        assert {"cpu_s", "wall_s", "other_cpu_s"} <= row["cpu"].keys()
        if row["mode"].startswith("pipeline"):
            assert row["redis"]["commands_per_request"] > 0
            assert {"preprocess", "inference", "postprocess", "api"} <= row["cpu"]["cpu_s"].keys()
            # Against `vllm serve` the stack is `llmpipe up`'s, Flower included; against the floor, no monitor.
            assert ("flower" in row["cpu"]["cpu_s"]) is (row["engine"] == "real")
    labels = {p["engine"]: p["label"] for p in result["plans"]}
    assert "SIMULATED" in labels["simulated"]

    md = (out / "report.md").read_text()
    assert "SIMULATED" in md and "pipeline-window50" in md and "p99" in md
    for engine in ("noop", "simulated", "real"):
        png = out / f"latency_cdf_{engine}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
