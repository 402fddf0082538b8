from __future__ import annotations

import pytest

from llmpipe.testing.hosts import netns


@pytest.fixture
def hosts(tmp_path):
    """A fresh Hosts (10 ms each way on routes), torn down even when the test fails."""
    why = netns.available()
    if why:
        pytest.skip(why)
    from llmpipe.testing.hosts.harness import Hosts

    h = Hosts(tmp_path / "hosts", one_way_delay_ms=10)
    yield h
    h.close()
