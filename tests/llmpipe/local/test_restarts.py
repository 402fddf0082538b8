"""The restart policy of ``llmpipe up`` on a fake clock: backoff, its reset after a stable
run, and giving up at the N-th crash within the window."""

from __future__ import annotations

import pytest

from llmpipe.local.restarts import RestartPolicy
from llmpipe.settings import Settings
from tests.harness.clock import ManualClock


def _crash_loop(policy: RestartPolicy, clock: ManualClock, up_s: float, n: int) -> list[float | None]:
    """``n`` runs that each crash ``up_s`` after their start, restarted after each delay."""
    delays = []
    for _ in range(n):
        policy.started()
        clock.t += up_s
        d = policy.crashed()
        delays.append(d.delay_s)
        if d.give_up:
            break
        clock.t += d.delay_s
    return delays


def test_backoff_doubles_to_the_cap():
    clock = ManualClock()
    p = RestartPolicy(max_crashes=100, window_s=10_000, clock=clock)
    assert _crash_loop(p, clock, up_s=0.5, n=8) == [1, 2, 4, 8, 16, 30, 30, 30]


def test_gives_up_at_the_nth_crash_within_the_window():
    clock = ManualClock()
    p = RestartPolicy(max_crashes=5, window_s=300, clock=clock)
    delays = _crash_loop(p, clock, up_s=1, n=10)
    assert delays == [1, 2, 4, 8, None]
    p2 = RestartPolicy(max_crashes=1, window_s=300, clock=clock)
    p2.started()
    assert p2.crashed().give_up  # 1: never restart


def test_crashes_older_than_the_window_do_not_count():
    clock = ManualClock()
    p = RestartPolicy(max_crashes=3, window_s=300, stable_s=60, clock=clock)
    p.started()
    clock.t += 100
    first = p.crashed()
    assert (first.delay_s, first.crashes) == (1, 1)
    p.started()
    clock.t += 150
    second = p.crashed()
    assert (second.delay_s, second.crashes) == (1, 2)  # up 150 s: the backoff started over
    p.started()
    clock.t += 200  # 350 s after the first crash: it has left the window
    third = p.crashed()
    assert not third.give_up and third.crashes == 2
    p.started()
    clock.t += 5
    assert p.crashed().give_up  # three within 300 s


def test_backoff_resets_after_a_stable_run():
    clock = ManualClock()
    p = RestartPolicy(max_crashes=100, window_s=10_000, stable_s=60, clock=clock)
    assert _crash_loop(p, clock, up_s=1, n=4) == [1, 2, 4, 8]
    assert _crash_loop(p, clock, up_s=59, n=1) == [16]  # not quite stable
    assert _crash_loop(p, clock, up_s=60, n=3) == [1, 1, 1]  # stable each time: 1 s each time


def test_the_decision_says_what_the_console_line_needs():
    clock = ManualClock()
    p = RestartPolicy(max_crashes=5, window_s=300, clock=clock)
    p.started()
    d = p.crashed(now=clock.t + 3)  # an explicit time wins over the clock
    assert (d.delay_s, d.crashes, d.max_crashes, d.window_s, d.give_up) == (1, 1, 5, 300, False)


def test_policy_settings_have_defaults_and_bounds():
    s = Settings()
    assert (s.restart_max_crashes, s.restart_window_s) == (5, 300)
    with pytest.raises(ValueError):
        Settings(restart_max_crashes=0)
    with pytest.raises(ValueError):
        RestartPolicy(max_crashes=0)
