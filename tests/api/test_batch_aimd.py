"""The window of a batch's lines in flight (llmpipe/batches/aimd.py), with a fake clock."""

from __future__ import annotations

import pytest

from llmpipe.batches.aimd import Aimd


def test_a_429_halves_the_window_once_per_hold():
    t = [0.0]
    w = Aimd(64, hold_s=1.0, clock=lambda: t[0])
    assert w.window == 64
    assert w.overloaded() and w.window == 32
    assert not w.overloaded() and w.window == 32  # the same burst of refusals
    t[0] = 0.99
    assert not w.overloaded()
    t[0] = 1.0
    assert w.overloaded() and w.window == 16
    for _ in range(10):
        t[0] += 1
        w.overloaded()
    assert w.window == 1  # never below the floor


def test_admissions_grow_it_by_one_per_window_back_to_the_max():
    w = Aimd(8, initial=4)
    for _ in range(4):
        w.admitted()
    assert w.window == 4  # 4 + 1/4 + 1/4.25 + ... : just under one more line
    w.admitted()
    assert w.window == 5  # about a window's worth of admissions: one more line
    for _ in range(200):
        w.admitted()
    assert w.window == 8


def test_bounds():
    assert Aimd(10, initial=50).window == 10 and Aimd(10, initial=0).window == 1
    with pytest.raises(ValueError):
        Aimd(10, decrease=1.0)
