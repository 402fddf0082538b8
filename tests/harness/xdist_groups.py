"""The pytest-xdist side of tests/harness/distribute.py (loaded by tests/conftest.py when
xdist is installed): the controller hands out whole groups, in collection order.

xdist's own ``--dist loadgroup`` reads ``xdist_group`` marks through a suffix it writes
into each item's node id, which pytest 9.2's structured node ids no longer take; so the
first worker writes each test's group to a file the controller names, and the
controller's scheduler (``GroupScheduling``) reads the groups from there."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

GROUPS_KEY = "llmpipe_groups_file"
GROUPS_FILE = pytest.StashKey[str]()  # the controller's file of the groups


@pytest.hookimpl(trylast=True)  # after tests/harness/plugin.py marked the groups
def pytest_collection_modifyitems(config, items) -> None:
    """In the first worker: each collected test's group, to the controller's file."""
    workerinput = getattr(config, "workerinput", None)
    if not workerinput or workerinput.get("workerid") != "gw0" or GROUPS_KEY not in workerinput:
        return
    groups = {item.nodeid: item.get_closest_marker("xdist_group").args[0] for item in items}
    path = Path(workerinput[GROUPS_KEY])
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(groups))
    os.replace(tmp, path)  # whole or absent when the controller reads it


class GroupScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with the groups of tests/harness/distribute.py as scopes."""

    def __init__(self, config, log=None):
        super().__init__(config, log)
        self._groups: dict[str, str] | None = None
        self._path = Path(config.stash[GROUPS_FILE])

    def _split_scope(self, nodeid: str) -> str:
        # Called once the workers' collections are complete: gw0 wrote the file in its
        # collection, before it reported it.
        if self._groups is None:  # absent if gw0's collection failed: modules stay whole
            self._groups = json.loads(self._path.read_text()) if self._path.exists() else {}
        return self._groups.get(nodeid, nodeid.split("::", 1)[0])


def controlling(config) -> bool:
    return not hasattr(config, "workerinput") and config.getoption("dist", "no") != "no"


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    if controlling(config):
        fd, path = tempfile.mkstemp(prefix="llmpipe-xdist-groups-", suffix=".json")
        os.close(fd)
        os.unlink(path)
        config.stash[GROUPS_FILE] = path


def pytest_unconfigure(config):
    path = config.stash.get(GROUPS_FILE, None)
    if path:
        Path(path).unlink(missing_ok=True)


def pytest_configure_node(node):
    node.workerinput[GROUPS_KEY] = node.config.stash[GROUPS_FILE]


def pytest_xdist_make_scheduler(config, log):
    return GroupScheduling(config, log)
