"""The hand-out order of tests/harness/distribute.py: the longest modules' groups first, then
the groups that start stacks, the unit tests last; a group's tests stay together."""

from types import SimpleNamespace

import pytest

from tests.harness.distribute import LONGEST, distribute, hand_out_order


class _Item:
    """What the ordering reads of a collected test: its node id, its marks, its fixtures."""

    def __init__(self, nodeid: str, integration: bool = False):
        self.nodeid = nodeid
        self.marks = [pytest.mark.integration.mark] if integration else []
        self._fixtureinfo = SimpleNamespace(name2fixturedefs={})

    def get_closest_marker(self, name: str):
        return next((m for m in self.marks if m.name == name), None)

    def add_marker(self, mark) -> None:
        self.marks.append(mark.mark)


def test_longest_then_stacks_then_unit_tests_each_in_collection_order():
    items = [_Item("tests/api/test_a.py::t1"), _Item("tests/integration/test_b.py::t1", integration=True),
             _Item("tests/api/test_c.py::t1"), _Item(f"{LONGEST[1]}::t1", integration=True),
             _Item("tests/api/test_c.py::t2"), _Item("tests/integration/test_d.py::t1"),
             _Item("tests/integration/test_d.py::t2", integration=True), _Item(f"{LONGEST[0]}::t1", integration=True)]
    assert hand_out_order(items) == [LONGEST[0], LONGEST[1], "tests/integration/test_b.py",
                                     "tests/integration/test_d.py", "tests/api/test_a.py", "tests/api/test_c.py"]
    distribute(items)
    assert [i.nodeid for i in items] == [
        f"{LONGEST[0]}::t1", f"{LONGEST[1]}::t1", "tests/integration/test_b.py::t1", "tests/integration/test_d.py::t1",
        "tests/integration/test_d.py::t2", "tests/api/test_a.py::t1", "tests/api/test_c.py::t1", "tests/api/test_c.py::t2"]
    assert items[-1].get_closest_marker("xdist_group").args == ("tests/api/test_c.py",)
