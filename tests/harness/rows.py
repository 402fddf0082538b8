"""The reliability table: one row per scenario (jobs sent, completed, lost, duplicated,
recovery time, peak memory), printed at the end of the run and, when
LLMPIPE_RELIABILITY_OUT names a file, written there as JSON.

A test adds its row with ``record`` (``rel.record``); the row travels on the test's report
(its user_properties), so the table is gathered where reports are, in the one pytest
process or in pytest-xdist's controller."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

KEY = "reliability_row"
COLUMNS = ["scenario", "sent", "completed", "lost", "duplicated", "recovery_s", "peak_rss_mb", "redis_peak_mb",
           "wall_s"]
ROWS: list[dict] = []  # gathered from the reports
_current: list[pytest.Item] = []  # the test running in this process


def record(row: dict) -> None:
    """Adds ``row`` to the table (on the running test's report) and prints it."""
    print("\nreliability:", json.dumps(row))
    if _current:
        _current[-1].user_properties.append((KEY, row))


def running(item: pytest.Item | None) -> None:
    """The test now running in this process (None: none)."""
    _current[:] = [item] if item is not None else []


def gather(report) -> None:
    """Takes the rows off a test's last report (teardown holds them all)."""
    if report.when != "teardown":
        return
    rows = [v for k, v in getattr(report, "user_properties", ()) if k == KEY]
    if not rows:
        return
    ROWS.extend(rows)
    out = os.environ.get("LLMPIPE_RELIABILITY_OUT")
    if out:
        Path(out).write_text(json.dumps(ROWS, indent=1))


def summary(tr) -> None:
    if not ROWS:
        return
    tr.section("reliability")
    tr.write_line(" | ".join(COLUMNS))
    for row in ROWS:
        tr.write_line(" | ".join(str(row.get(c, "")) for c in COLUMNS))
