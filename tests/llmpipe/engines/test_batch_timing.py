"""A static batch's time split into the first token and the decode steps, wall and CPU."""

from __future__ import annotations

from llmpipe.engines.batch_timing import BatchTimer, BatchTiming, is_log_line, log_line
from tests.harness.clock import ManualClock


def test_the_first_token_and_each_decode_step_are_timed_in_wall_and_cpu_time():
    wall, cpu = ManualClock(), ManualClock(50.0)
    timer = BatchTimer(3, 512, clock=wall, cpu_clock=cpu)
    wall.advance(0.200)
    cpu.advance(0.150)
    timer.first_token()
    for _ in range(4):
        wall.advance(0.030)
        cpu.advance(0.010)
        timer.step()
    timer.first_token()  # only the first call counts
    t = timer.done()
    assert (t.requests, t.prompt_width, t.steps) == (3, 512, 4)
    assert round(t.first_s, 6) == 0.2 and round(t.first_cpu_s, 6) == 0.15
    assert round(t.decode_s, 6) == 0.12 and round(t.decode_cpu_s, 6) == 0.04
    assert t.describe() == ("batch of 3, prompt width 512: first token 200 ms (cpu 150), 4 decode steps 30.0 ms each "
                            "(cpu 10.0)")


def test_a_batch_that_ends_at_its_first_token_has_no_decode_steps():
    wall = ManualClock()
    timer = BatchTimer(1, 7, clock=wall, cpu_clock=ManualClock())
    wall.advance(0.05)
    t = timer.done()  # no first_token: the whole time is the first token's
    assert t == BatchTiming(1, 7, 0, t.first_s, 0.0, 0.0, 0.0) and round(t.first_s, 6) == 0.05
    assert "0 decode steps 0.0 ms each" in t.describe()


def test_the_engines_log_line_is_told_from_other_lines():
    line = log_line(BatchTiming(2, 9, 1, 0.1, 0.1, 0.02, 0.01))
    assert line == "transformers batch of 2, prompt width 9: first token 100 ms (cpu 100), 1 decode steps 20.0 ms each (cpu 10.0)"
    assert is_log_line(f"[2026-12-04 15:23:01,002: INFO/MainProcess] {line}")
    assert not is_log_line("transformers engine ready in 3.1s (model=tiny, device=cpu)")
