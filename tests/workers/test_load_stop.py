"""An inference worker stopped while its engine loads: it takes the load's processes down
and exits with code 0 (workers/load_stop.py), on real processes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]

# The worker's stand-in: multiprocessing children as vLLM starts its engine core (spawned),
# some deaf to SIGTERM; each says its pid once its SIGTERM disposition is set. Nothing but
# the code under test stops them: they are not daemons, and os._exit skips atexit anyway.
WORKER = textwrap.dedent("""
    import multiprocessing, os, signal, sys, time

    from workers.load_stop import stop_children, stop_loading_worker

    def child(deaf, ready):
        if deaf:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        ready.put(os.getpid())
        time.sleep(600)

    class Heart:
        def stop(self):
            print("worker-offline", flush=True)

    if __name__ == "__main__":
        ctx = multiprocessing.get_context("spawn")
        ready = ctx.Queue()
        procs = [ctx.Process(target=child, args=(deaf == "deaf", ready)) for deaf in sys.argv[2:]]
        for p in procs:
            p.start()
        print(*sorted(ready.get(timeout=60) for _ in procs), flush=True)
        if sys.argv[1] == "children":
            print(*sorted(stop_children(grace_s=0.5)), flush=True)
            print(*[p.exitcode for p in procs], flush=True)
        else:
            stop_loading_worker(Heart())
            print("returned", flush=True)
""")


def _run(tmp_path, how: str, *children: str) -> tuple[subprocess.CompletedProcess, list[int]]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = subprocess.run([sys.executable, str(script), how, *children], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    lines = out.stdout.splitlines()
    return out, [int(pid) for pid in lines[0].split()] if lines else []


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_the_children_stop_on_sigterm_and_one_deaf_to_it_is_killed(tmp_path):
    out, pids = _run(tmp_path, "children", "plain", "deaf")
    assert out.returncode == 0, out.stderr
    assert len(pids) == 2 and out.stdout.splitlines()[1:] == [" ".join(map(str, pids)), "-15 -9"]


def test_a_worker_stopped_while_loading_says_offline_stops_its_loads_processes_and_exits_0(tmp_path):
    out, pids = _run(tmp_path, "worker", "plain", "plain")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[1:] == ["worker-offline"]  # and it never returned
    assert len(pids) == 2 and all(_gone(pid) for pid in pids)
