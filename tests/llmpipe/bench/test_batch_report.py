"""The Batch API benchmark's report (llmpipe/bench/batch_report.py), from a made-up result, and
how it times vllm run-batch (a stand-in command printing its log lines)."""

from __future__ import annotations

import itertools
import sys

import pytest

from llmpipe.bench import batch
from llmpipe.bench.batch import _pcts
from llmpipe.bench.batch_report import markdown


def _phase(ttfts: list[float | None]) -> dict:
    res = _pcts("http://unused", [(t, None) for t in ttfts])
    for n, r in enumerate(res["requests"]):
        r["job"], r["stages"] = f"job-{n}", {"preprocess": [0.002, 0.004], "inference": [0.9 if n == 1 else 0.01, 2.0]}
    return res


def test_the_report_places_the_slowest_requests_in_the_pipeline():
    idle, draining = _phase([0.2, 0.3, 0.25]), _phase([0.15, 1.4, None, 0.14])
    res = {"options": {"lines": 10, "prompt_tokens": 128, "max_tokens": 64},
           "meta": {"machine": "m", "started": "s"}, "model_path": "p",
           "interactive": {"idle": idle, "draining": draining, "ratio": {"p50": 0.6, "p99": 4.2},
                           "batch_still_draining_at_end": True}}
    md = markdown(res)
    assert "| draining | 0.150 | 1.375 | 3/4 |" in md
    assert "draining / idle: p50 0.60x, p99 4.20x; target <= 1.25x" in md
    slowest = [ln for ln in md.splitlines() if ln.startswith("- draining")]
    assert slowest[0] == "- draining, request 1 of the phase: TTFT 1.400 s; preprocess wait 2 run 4 ms, inference wait 900 run 2000 ms"
    assert len(slowest) == 3 and not any("request 2 " in ln for ln in slowest)  # the failed one has no TTFT


def test_a_request_with_no_job_has_no_stages():
    res = _pcts("http://unused", [(0.5, None), (None, None)])
    assert res["ok"] == 1 and res["requests"] == [{"ttft_s": 0.5, "job": None, "stages": None},
                                                 {"ttft_s": None, "job": None, "stages": None}]


def _fake_run_batch(monkeypatch, *lines: str, rc: int = 0) -> None:
    script = "".join(f"print({ln!r})\n" for ln in lines) + f"raise SystemExit({rc})\n"
    monkeypatch.setattr(batch, "run_batch_argv", lambda inp, out, model: [sys.executable, "-c", script])


def test_run_batch_is_timed_from_its_batch_to_its_shutdown(monkeypatch, tmp_path):
    _fake_run_batch(monkeypatch, "loading the model", "INFO Reading batch from in.jsonl", "Running batch: 100%",
                    "INFO Writing outputs to out.jsonl", "INFO [shutdown] MPClient: start", "bye")
    ticks = itertools.count()  # a clock read at the start, at each of the two lines, at the exit
    t = batch.time_run_batch(tmp_path / "in", tmp_path / "out", "m", {}, tmp_path / "log", clock=lambda: next(ticks))
    assert (t.seconds, t.batch_seconds, t.startup_seconds) == (3, 1, 2)
    assert (tmp_path / "log").read_text().splitlines()[1] == "INFO Reading batch from in.jsonl"


def test_a_run_batch_with_no_shutdown_line_is_timed_to_its_exit(monkeypatch, tmp_path):
    _fake_run_batch(monkeypatch, "INFO [shutdown] too early", "INFO Reading batch from in.jsonl", "done")
    ticks = itertools.count()
    t = batch.time_run_batch(tmp_path / "in", tmp_path / "out", "m", {}, tmp_path / "log", clock=lambda: next(ticks))
    assert (t.seconds, t.batch_seconds) == (2, 1)


def test_a_run_batch_that_never_began_its_batch_is_an_error(monkeypatch, tmp_path):
    _fake_run_batch(monkeypatch, "loading the model", "Traceback: out of memory")
    with pytest.raises(RuntimeError, match="before its batch began"):
        batch.time_run_batch(tmp_path / "in", tmp_path / "out", "m", {}, tmp_path / "log")
    _fake_run_batch(monkeypatch, "INFO Reading batch from in.jsonl", rc=3)
    with pytest.raises(RuntimeError, match="exited 3"):
        batch.time_run_batch(tmp_path / "in", tmp_path / "out", "m", {}, tmp_path / "log")
