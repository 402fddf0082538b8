"""The `ups` fixture: `llmpipe up` subprocesses (tests/harness/up.py) that a test starts,
each killed at the test's end if it is still running."""

from __future__ import annotations

import pytest

from tests.harness.up import Up


@pytest.fixture
def ups():
    started: list[Up] = []

    def start(*args, **kw) -> Up:
        up = Up(*args, **kw)
        started.append(up)
        return up

    yield start
    for up in started:
        if up.proc.poll() is None:
            up.kill()
