"""python -m benchmarks.cost.stage_cost: each stage's CPU per request, in a process of its own
(it takes over that process's settings and worker context)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_stage_cost_runs_the_three_stages_on_the_tiny_model(tiny_model):
    out = subprocess.run([sys.executable, "-m", "benchmarks.cost.stage_cost", "--model", tiny_model, "--requests", "5",
                          "--prompt-tokens", "64", "--max-tokens", "8", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    ms = json.loads(out.stdout.strip().splitlines()[-1])
    stages = ("preprocess", "inference", "postprocess")
    assert all(ms[s] > 0 for s in stages), ms
    assert abs(ms["total"] - sum(ms[s] for s in stages)) < 1e-9
    assert ms["tokenizer call"] > 0 and ms["redis round trip"] > 0
