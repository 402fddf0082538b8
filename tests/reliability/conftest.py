"""Real pipelines that the reliability tests hurt on purpose (docs/reliability.md).

Each module starts its own Redis and its own LocalPipeline (real Celery workers, the API,
the transformers engine on the tiny model) on the shipped lease and visibility settings (a
crashed worker's messages come back within lease_ttl_s + lease_sweep_interval_s), and,
where asked, the test-only fault injection of llmpipe/testing/faulty.py. The helpers live in
tests/harness/ and reach the tests through the ``rel`` fixture (a namespace).

Every scenario adds a row (jobs sent, completed, lost, duplicated, recovery time, peak
memory) with ``rel.record`` to the reliability table (tests/harness/rows.py).
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest

from tests.harness import faults
from tests.harness.fuzz import fuzz
from tests.harness.pipe import start_pipe, stop_pipe
from tests.harness.rows import record
from tests.harness.up import start_up, stop_up
from tests.harness.waiting import wait_until
from tests.harness.watch import MemSampler, ResultWatch


@pytest.fixture(scope="session")
def rel():
    return SimpleNamespace(
        FAULTS=faults.FAULTS, LEASE_TTL_S=faults.LEASE_TTL_S, LEASE_SWEEP_S=faults.LEASE_SWEEP_S,
        RECOVERY_S=faults.RECOVERY_S, SLACK_S=faults.SLACK_S,
        record=record,
        wait_until=partial(wait_until, every=faults.POLL_S),
        start_pipe=start_pipe, stop_pipe=stop_pipe, start_up=start_up, stop_up=stop_up,
        ResultWatch=ResultWatch, MemSampler=MemSampler, fuzz=fuzz,
    )
