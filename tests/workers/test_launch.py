"""The worker command lines: README.md shows exactly what ``llmpipe worker KIND`` runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmpipe.settings import Settings
from workers.launch import KINDS, celery_command, worker_argv

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def defaults(monkeypatch) -> Settings:
    for name in list(os.environ):
        if name.startswith("LLMPIPE_"):
            monkeypatch.delenv(name)
    return Settings()


@pytest.mark.parametrize("kind", list(KINDS))
def test_readme_shows_the_celery_line_llmpipe_worker_runs(defaults, kind):
    line = celery_command(kind, defaults)
    assert line.startswith(f"celery -A tasks worker -Q {','.join(KINDS[kind].queues)} -P {KINDS[kind].pool} ")
    assert f"`{line}`" in (ROOT / "README.md").read_text()


def test_celery_command_is_worker_argv_as_typed(defaults):
    argv = worker_argv("inference", defaults, concurrency=5, name="gpu0@%h")
    assert argv[:3] == [sys.executable, "-m", "celery"]
    assert celery_command("inference", defaults, concurrency=5, name="gpu0@%h") == " ".join(["celery", *argv[3:]])
    assert argv[argv.index("-c") + 1] == "5" and argv[argv.index("-n") + 1] == "gpu0@%h"


def test_llmpipe_worker_print_shows_the_line(defaults):
    from llmpipe.local.supervisor import python_env

    out = subprocess.run([sys.executable, "-m", "llmpipe.cli", "worker", "inference", "--print", "-c", "7"],
                         env=python_env({}), cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == celery_command("inference", defaults, concurrency=7)
