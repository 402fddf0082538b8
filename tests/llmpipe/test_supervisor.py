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

from rich.console import Console

from llmpipe.supervisor import Supervisor, alive, descendants, python_env

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
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from llmpipe.supervisor import Supervisor, python_env
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
