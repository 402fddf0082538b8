"""The suite in several processes (pytest-xdist: ``make test`` runs ``-n 2``, handed out by
tests/harness/xdist_groups.py): which tests one worker must run together, and in what
order the groups are handed out.

A group is what one worker runs whole, in collection order: a module (so that its
module-scoped stacks start once) joined with every module that borrows the same shared
stack (its ``@lends`` keys: tests/harness/shared.py), so that no stack starts in two
workers. The longest groups go out first (``LONGEST``), so that the run does not end with
one worker alone on the Compose test while the other idles; then the other groups that
start stacks, and the unit tests last, each kind in the order it was collected: their many
short groups fill the run's end on both workers, where a stack's group handed out late
had left one worker idle for a minute or more. Without xdist the marks do nothing and
only the order changes."""

from __future__ import annotations

from collections.abc import Hashable

import pytest

from tests.harness.shared import keys_of

# The modules that run longest in `make test` (its durations report): each one's group is
# handed out before every other group, in this order. The run's controller builds the
# Compose test's images from the run's start (tests/deploy/prebuild.py): a cold build took
# 6.5 min beside the tests here, so the two modules that wait for it (the Compose test, and
# the kill matrix: its inference worker's restart compiles the engine again, and beside the
# build it had not served within 300 s of the kill in CI, against 34 s alone) come last of
# these, after long groups that wait for nothing.
LONGEST = (
    "tests/llmpipe/bench/test_multiworker.py",
    "tests/reliability/test_overload.py",
    "tests/reliability/test_worker_failover.py",
    "tests/llmpipe/local/test_up_inference_workers.py",
    "tests/benchmarks/test_gpu_rehearsal.py",
    "tests/integration/test_batches.py",
    "tests/reliability/test_kill_matrix.py",
    "tests/deploy/test_compose_up.py",
)


class _Groups:
    """Union-find over modules and shared-stack keys."""

    def __init__(self):
        self.parent: dict[Hashable, Hashable] = {}

    def find(self, x: Hashable) -> Hashable:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def join(self, a: Hashable, b: Hashable) -> None:
        self.parent[self.find(a)] = self.find(b)


def module_of(item) -> str:
    return item.nodeid.split("::", 1)[0]


def group_names(items) -> dict[str, str]:
    """Each module -> the name of its group (the group's first module in collection order)."""
    g = _Groups()
    for item in items:
        mod = ("module", module_of(item))
        g.find(mod)
        for key in keys_of(item):
            g.join(("stack", key), mod)
    first: dict[Hashable, str] = {}
    for item in items:
        first.setdefault(g.find(("module", module_of(item))), module_of(item))
    return {module_of(i): first[g.find(("module", module_of(i)))] for i in items}


def _rank(members: set[str]) -> int:
    ranks = [LONGEST.index(m) for m in members if m in LONGEST]
    return min(ranks) if ranks else len(LONGEST)


def hand_out_order(items) -> list[str]:
    """The groups, in the order they go out: LONGEST's, then those with an integration
    test, then the rest; collection order within each."""
    names = group_names(items)
    members: dict[str, set[str]] = {}
    stacks: set[str] = set()
    for item in items:
        group = names[module_of(item)]
        members.setdefault(group, set()).add(module_of(item))
        if item.get_closest_marker("integration") is not None:
            stacks.add(group)
    order = {g: i for i, g in enumerate(dict.fromkeys(names[module_of(i)] for i in items))}
    return sorted(order, key=lambda g: (_rank(members[g]), g not in stacks, order[g]))


def distribute(items: list) -> None:
    """Marks each item with its group (``xdist_group``) and puts the groups in hand-out
    order, each one's items together and in their collected order."""
    names = group_names(items)
    rank = {group: i for i, group in enumerate(hand_out_order(items))}
    for item in items:
        item.add_marker(pytest.mark.xdist_group(names[module_of(item)]))
    items.sort(key=lambda i: rank[names[module_of(i)]])
