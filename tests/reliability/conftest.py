"""Real pipelines that the reliability tests hurt on purpose (docs/reliability.md).

Each module starts its own Redis and its own LocalPipeline (real Celery workers, the API,
the transformers engine on the tiny model) on the shipped lease and visibility settings (a
crashed worker's messages come back within lease_ttl_s + lease_sweep_interval_s), and,
where asked, the test-only fault injection of llmpipe/engines/faulty.py. The helpers live in
``harness/`` and reach the tests through the ``rel`` fixture (a namespace).

Every scenario adds a row (jobs sent, completed, lost, duplicated, recovery time, peak
memory) to ``ROWS``; the rows are printed at the end of the session and, when
LLMPIPE_RELIABILITY_OUT names a file, written there as JSON.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.reliability.harness.common import FAULTS, LEASE_SWEEP_S, LEASE_TTL_S, RECOVERY_S, SLACK_S, wait_until
from tests.reliability.harness.fuzz import fuzz
from tests.reliability.harness.pipe import start_pipe, stop_pipe
from tests.reliability.harness.up_pipe import start_up, stop_up
from tests.reliability.harness.watch import MemSampler, ResultWatch

ROWS: list[dict] = []


def record(row: dict) -> None:
    ROWS.append(row)
    print("\nreliability:", json.dumps(row))
    out = os.environ.get("LLMPIPE_RELIABILITY_OUT")
    if out:
        Path(out).write_text(json.dumps(ROWS, indent=1))


def pytest_terminal_summary(terminalreporter):
    if not ROWS:
        return
    tr = terminalreporter
    tr.section("reliability")
    cols = ["scenario", "sent", "completed", "lost", "duplicated", "recovery_s", "peak_rss_mb", "redis_peak_mb", "wall_s"]
    tr.write_line(" | ".join(cols))
    for row in ROWS:
        tr.write_line(" | ".join(str(row.get(c, "")) for c in cols))


@pytest.fixture(scope="session")
def rel():
    return SimpleNamespace(
        FAULTS=FAULTS, LEASE_TTL_S=LEASE_TTL_S, LEASE_SWEEP_S=LEASE_SWEEP_S, RECOVERY_S=RECOVERY_S, SLACK_S=SLACK_S,
        record=record,
        wait_until=wait_until,
        start_pipe=start_pipe, stop_pipe=stop_pipe, start_up=start_up, stop_up=stop_up,
        ResultWatch=ResultWatch, MemSampler=MemSampler, fuzz=fuzz,
    )
