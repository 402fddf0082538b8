"""The Supervisor: log files and a prefixed console, warm and forced stops, stages, and no
orphan left (grandchildren, and children of a supervisor that is SIGKILLed)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from llmpipe.local.supervisor import Supervisor, alive, descendants, python_env
from tests.harness.clock import ManualClock

PY = sys.executable


def _console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=200, color_system=None, force_terminal=False), buf


def _py(code: str) -> list[str]:
    return [PY, "-c", textwrap.dedent(code)]


def _wait_for(pred, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def _wait_line(sup_child, text: str, timeout: float = 10.0) -> str:
    assert _wait_for(lambda: any(text in ln for ln in sup_child.tail), timeout), sup_child.tail
    return next(ln for ln in sup_child.tail if text in ln)


# A child that says it is ready, exits warm on SIGTERM after `delay`, or ignores SIGTERM.
_TERM_CHILD = """
import signal, sys, time
def on_term(*_):
    print("got TERM", time.time(), flush=True)
    time.sleep({delay})
    print("warm exit", time.time(), flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, {handler})
print("ready", flush=True)
while True:
    time.sleep(0.1)
"""


def term_child(delay: float = 0.0, ignore: bool = False) -> list[str]:
    return _py(_TERM_CHILD.format(delay=delay, handler="signal.SIG_IGN" if ignore else "on_term"))


def test_log_files_and_prefixed_console(tmp_path):
    console, buf = _console()
    sup = Supervisor(tmp_path / "logs", console=console)
    a = sup.spawn("alpha", _py("print('hello'); print('[bold]not markup[/] [/]')"), python_env({}))
    b = sup.spawn("beta", _py("import sys; print('to stderr', file=sys.stderr)"), python_env({}))
    assert _wait_for(lambda: len(sup.exited()) == 2)
    assert sup.stop(timeout=5)
    assert (tmp_path / "logs" / "alpha.log").read_text() == "hello\n[bold]not markup[/] [/]\n"
    assert (tmp_path / "logs" / "beta.log").read_text() == "to stderr\n"
    lines = buf.getvalue().splitlines()
    assert "alpha       | hello" in lines
    assert "alpha       | [bold]not markup[/] [/]" in lines  # child output is never markup
    assert "beta        | to stderr" in lines
    assert a.proc.returncode == 0 and b.proc.returncode == 0


def test_console_shows_warnings_and_errors_the_file_keeps_everything(tmp_path):
    import logging

    console, buf = _console()
    sup = Supervisor(tmp_path / "logs", console=console, echo_level=logging.WARNING)
    lines = ["[2026-11-30 11:41:40,011: INFO/MainProcess] Connected",
             "[2026-11-30 11:41:41,000: INFO/MainProcess] (EngineCore pid=7) WARNING 11-30 11:41:41 [x.py:1] careful",
             "[2026-11-30 11:41:42,000: ERROR/MainProcess] Task failed", "Traceback (most recent call last):",
             "  File \"x.py\", line 1", "[2026-11-30 11:41:43,000: INFO/MainProcess] Task ok"]
    sup.spawn("gamma", _py(f"print({chr(10).join(lines)!r})"), python_env({}))
    assert _wait_for(lambda: len(sup.exited()) == 1)
    assert sup.stop(timeout=5)
    assert (tmp_path / "logs" / "gamma.log").read_text().splitlines() == lines
    shown = [ln.removeprefix("gamma       | ") for ln in buf.getvalue().splitlines()]
    assert shown == lines[1:5]


def test_warm_stop_lets_children_finish(tmp_path):
    sup = Supervisor(tmp_path, echo=False)
    child = sup.spawn("w", term_child(delay=0.3), python_env({}))
    _wait_line(child, "ready")
    assert sup.stop(timeout=10) is True
    assert child.proc.returncode == 0
    assert "warm exit" in (tmp_path / "w.log").read_text()


def test_stages_stop_in_order(tmp_path):
    sup = Supervisor(tmp_path, echo=False)
    first = sup.spawn("first", term_child(delay=0.5), python_env({}))
    second = sup.spawn("second", term_child(), python_env({}))
    rest = sup.spawn("rest", term_child(), python_env({}))
    for c in (first, second, rest):
        _wait_line(c, "ready")
    assert sup.stop(timeout=10, order=[["first"], ["second"]])
    t_first_exit = float(_wait_line(first, "warm exit").split()[-1])
    t_second_term = float(_wait_line(second, "got TERM").split()[-1])
    t_rest_term = float(_wait_line(rest, "got TERM").split()[-1])
    assert t_first_exit <= t_second_term <= t_rest_term


def test_force_event_kills_at_once(tmp_path):
    sup = Supervisor(tmp_path, echo=False)
    child = sup.spawn("stubborn", term_child(ignore=True), python_env({}))
    _wait_line(child, "ready")
    force = threading.Event()
    threading.Timer(0.3, force.set).start()
    t0 = time.monotonic()
    assert sup.stop(timeout=60, force_event=force) is False
    assert time.monotonic() - t0 < 10
    assert child.proc.returncode == -signal.SIGKILL


def test_timeout_kills(tmp_path):
    sup = Supervisor(tmp_path, echo=False)
    child = sup.spawn("stubborn", term_child(ignore=True), python_env({}))
    _wait_line(child, "ready")
    assert sup.stop(timeout=0.5) is False
    assert child.proc.returncode == -signal.SIGKILL


def test_no_grandchild_outlives_stop(tmp_path):
    # The child exits warm but leaves a grandchild that ignores SIGTERM behind.
    code = """
    import signal, subprocess, sys, time
    g = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    print("grandchild", g.pid, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        time.sleep(0.1)
    """
    sup = Supervisor(tmp_path, echo=False)
    child = sup.spawn("parent", _py(code), python_env({}))
    gpid = int(_wait_line(child, "grandchild").split()[1])
    assert gpid in descendants(os.getpid())
    assert sup.stop(timeout=10)
    assert _wait_for(lambda: not alive(gpid), 5), f"grandchild {gpid} outlived the supervisor"


def test_children_die_with_a_killed_supervisor(tmp_path):
    # A supervisor killed with SIGKILL cannot stop anything: the kernel does (PDEATHSIG).
    script = tmp_path / "sup.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).resolve().parents[3])!r})
        from llmpipe.local.supervisor import Supervisor, python_env
        sup = Supervisor({str(tmp_path / "logs")!r}, echo=False)
        c = sup.spawn("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"], python_env({{}}))
        print(c.proc.pid, flush=True)
        time.sleep(600)
    """))
    proc = subprocess.Popen([PY, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(proc.stdout.readline())
        assert alive(child_pid)
        proc.kill()
        proc.wait(5)
        assert _wait_for(lambda: not alive(child_pid), 5), "child outlived its killed supervisor"
    finally:
        proc.kill()
        proc.wait()


def test_descendants_and_alive():
    proc = subprocess.Popen([PY, "-c", "import time; time.sleep(30)"])
    try:
        assert proc.pid in descendants(os.getpid())
        assert alive(proc.pid)
    finally:
        proc.kill()
    # Killed but not yet reaped: a zombie, which counts as dead.
    assert _wait_for(lambda: not alive(proc.pid), 5)
    proc.wait()
    assert not alive(proc.pid)


def test_stop_after_children_exited_is_harmless(tmp_path):
    sup = Supervisor(tmp_path, echo=False)
    child = sup.spawn("quick", _py("pass"), python_env({}))
    assert _wait_for(lambda: child.proc.poll() is not None)
    assert sup.stop(timeout=1)
    assert sup.exited() == [child]


def test_respawn_restarts_an_exited_child_in_place(tmp_path):
    console, _ = _console()
    sup = Supervisor(tmp_path, console=console)
    child = sup.spawn("worker", _py("import sys; print('run', flush=True); sys.exit(70)"), python_env({}))
    assert _wait_for(lambda: child.proc.poll() is not None)
    first_pid = child.proc.pid
    assert child.proc.returncode == 70 and sup.exited() == [child]
    sup.respawn(child)
    assert child.restarts == 1 and child.proc.pid != first_pid
    assert _wait_for(lambda: child.proc.poll() is not None)
    sup.stop(timeout=5)
    assert (tmp_path / "worker.log").read_text().count("run") == 2  # one log file across restarts


# -- restarts (llmpipe up supervises; the policy itself: test_restarts.py) ------------------


def _policy(clock, **kw):
    from llmpipe.local.restarts import RestartPolicy

    return RestartPolicy(**{"max_crashes": 5, "window_s": 300, **kw}, clock=clock)


# Dies by SIGKILL, leaving a grandchild in its process group (a pool process, an engine core).
_DIES_LEAVING_A_GRANDCHILD = """
import os, signal, subprocess, sys
g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("run", g.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_tend_restarts_a_crashed_child_after_the_policy_delay(tmp_path):
    clock = ManualClock(100.0)
    sup = Supervisor(tmp_path, echo=False, clock=clock)
    child = sup.spawn("worker", _py(_DIES_LEAVING_A_GRANDCHILD), python_env({}), _policy(clock))
    grandchild = int(_wait_line(child, "run").split()[1])
    assert _wait_for(lambda: child.proc.poll() is not None)
    first_pid = child.proc.pid
    assert alive(grandchild)

    clock.t += 42  # it ran 42 s
    [crash] = sup.tend()
    assert crash.child is child and crash.returncode == -signal.SIGKILL and crash.uptime_s == 42
    assert (crash.decision.delay_s, crash.decision.crashes) == (1, 1)
    # The dead child's process group went with it, before any restart.
    assert _wait_for(lambda: not alive(grandchild), 5), "the dead child's group outlived it"
    clock.t += 0.99
    assert sup.tend() == [] and child.proc.pid == first_pid  # not yet: the backoff
    clock.t += 0.01
    assert sup.tend() == []
    assert child.proc.pid != first_pid and child.restarts == 1 and child.restart_at is None
    second_grandchild = int(_wait_line(child, "run").split()[1])
    assert second_grandchild != grandchild and child.tail[0].startswith("run")  # this run's lines only

    # It crashes again at once: the delay doubles.
    assert _wait_for(lambda: child.proc.poll() is not None)
    clock.t += 0.5
    [again] = sup.tend()
    assert (again.decision.delay_s, again.decision.crashes) == (2, 2)
    assert sup.stop(timeout=5)
    assert _wait_for(lambda: not alive(second_grandchild), 5)


def test_tend_gives_up_and_leaves_the_child_down(tmp_path):
    clock = ManualClock(100.0)
    sup = Supervisor(tmp_path, echo=False, clock=clock)
    child = sup.spawn("flaky", _py("import sys; sys.exit(2)"), python_env({}), _policy(clock, max_crashes=2))
    assert _wait_for(lambda: child.proc.poll() is not None)
    [first] = sup.tend()
    assert first.returncode == 2 and not first.decision.give_up
    clock.t += first.decision.delay_s
    sup.tend()
    assert child.restarts == 1
    assert _wait_for(lambda: child.proc.poll() is not None)
    [second] = sup.tend()
    assert second.decision.give_up and child.given_up
    clock.t += 3600
    assert sup.tend() == [] and child.restarts == 1  # stays down, reported once
    sup.stop(timeout=5)


def test_no_restart_once_stop_began_and_unsupervised_children_are_left_alone(tmp_path):
    clock = ManualClock(100.0)
    sup = Supervisor(tmp_path, echo=False, clock=clock)
    supervised = sup.spawn("supervised", term_child(), python_env({}), _policy(clock))
    plain = sup.spawn("plain", _py("pass"), python_env({}))
    _wait_line(supervised, "ready")
    assert _wait_for(lambda: plain.proc.poll() is not None)
    assert sup.tend() == []  # a child without a policy is its owner's business
    assert sup.stop(timeout=10)
    clock.t += 3600
    assert sup.tend() == [] and supervised.restarts == 0 and supervised.proc.returncode == 0


def test_crash_line_says_who_how_and_when_never_a_stale_phase(tmp_path):
    from llmpipe.local.pipeline import crash_line, exit_reason
    from llmpipe.local.restarts import Decision
    from llmpipe.local.supervisor import Child, Crash

    class Done:
        def __init__(self, code):
            self.returncode = code
            self.pid = 1

    killed = Child("inference", [], {}, tmp_path / "inference.log", proc=Done(-signal.SIGKILL),
                   tail=["[2026-11-30 11:41:40,011: INFO/MainProcess] loading engine vllm for model tiny"])
    line = crash_line(Crash(killed, -signal.SIGKILL, 42.4, Decision(1.0, 1, 5, 300.0)))
    assert line == "inference was killed by SIGKILL after 42 s; restarting in 1 s (crash 1 of 5 in 300 s)"
    assert "loading engine" not in exit_reason(killed)
    died = Child("inference", [], {}, tmp_path / "inference.log", proc=Done(70),
                 tail=["llmpipe: engine died (EngineDeadError: gone); requeued 3 messages; exiting with 70", "bye"])
    line = crash_line(Crash(died, 70, 3.21, Decision(4.0, 3, 5, 300.0)))
    assert line == ("inference exited with code 70 after 3.2 s (engine died (EngineDeadError: gone); requeued 3 "
                    "messages; exiting with 70); restarting in 4 s (crash 3 of 5 in 300 s)")
    gave_up = crash_line(Crash(killed, -signal.SIGKILL, 1.0, Decision(None, 5, 5, 300.0)))
    assert gave_up.startswith("inference was killed by SIGKILL after 1.0 s; 5 crashes within 300 s")
    assert "giving up" in gave_up and str(tmp_path / "inference.log") in gave_up


def test_local_pipeline_tend_prints_restarts_and_stops_on_a_start_failure(tmp_path):
    from llmpipe.local.pipeline import START_FAILURES, LocalPipeline, PipelineError
    from llmpipe.settings import Settings

    console, buf = _console()
    clock = ManualClock(100.0)
    lp = LocalPipeline(Settings(state_dir=tmp_path, restart_max_crashes=3), console=console, restarts=True,
                       clock=clock)
    crashing = lp.sup.spawn("api", _py("import sys; sys.exit(1)"), python_env({}), lp._policy())
    assert _wait_for(lambda: crashing.proc.poll() is not None)
    [crash] = lp.tend()
    assert crash.decision.delay_s == 1
    assert "llmpipe up: api exited with code 1 after 0.0 s; restarting in 1 s (crash 1 of 3 in 300 s)" in buf.getvalue()
    # A worker that cannot start as configured (exit 3) before the stack ever served: the
    # reason, and no restart loop.
    bad = lp.sup.spawn("inference", _py("print('llmpipe: engine vllm could not start: bad dtype'); raise SystemExit(3)"),
                       python_env({}), lp._policy())
    assert _wait_for(lambda: bad.proc.poll() is not None)
    with pytest.raises(PipelineError, match="inference exited with code 3: engine vllm could not start: bad dtype"):
        lp.tend()
    bad.ever_ready = True  # once it has served, the same exit is a crash like any other
    assert [c.child.name for c in lp.tend()] == ["inference"]
    assert 3 in START_FAILURES
    lp.stop(timeout=5)
