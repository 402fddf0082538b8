"""Placement: the CPUs an engine's processes are bound to, the ones left, and a process
tree moved onto them (real processes; the affinity probe injected where a tree is made up)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from llmpipe.local import pipeline as local_pipeline
from llmpipe.local.pipeline import FLOWER, LocalPipeline
from llmpipe.local.placement import WATCHER_NICE, Placement, affinity, engine_cpus, free_cpus, pin, supported
from llmpipe.local.supervisor import Supervisor, descendants
from llmpipe.settings import Settings
from tests.harness.waiting import wait_until

HOST = affinity(0)
two_cpus = pytest.mark.skipif(len(HOST) < 2, reason="needs two CPUs to bind one process away from another")


def test_the_engine_cpus_are_the_narrower_bindings_below_the_roots():
    tree = {1: {2, 3, 4}, 10: {11}}
    bound = {2: frozenset({0}), 3: frozenset({0, 1, 2, 3}), 11: frozenset({2})}

    def affinity_of(pid: int) -> frozenset[int]:
        if pid not in bound:
            raise ProcessLookupError(pid)  # exited since it was listed
        return bound[pid]

    host = frozenset({0, 1, 2, 3})
    assert engine_cpus([1, 10], host, below=tree.__getitem__, affinity_of=affinity_of) == {0, 2}
    assert engine_cpus([1], host, below=tree.__getitem__, affinity_of=affinity_of) == {0}
    assert engine_cpus([], host, below=tree.__getitem__, affinity_of=affinity_of) == frozenset()


def test_the_free_cpus_are_the_rest_and_none_when_nothing_or_everything_is_bound():
    assert free_cpus(frozenset({0, 1}), frozenset({0})) == {1}
    assert free_cpus(frozenset({0, 1, 2, 3}), frozenset({0, 2})) == {1, 3}
    assert free_cpus(frozenset({0, 1}), frozenset()) is None  # a GPU engine binds nothing
    assert free_cpus(frozenset({0, 1}), frozenset({0, 1})) is None  # nothing left to move to


def test_an_unlearned_placement_moves_nothing():
    p = Placement(frozenset({0, 1}))
    assert p.cpus is None
    p.apply([os.getpid()])  # no CPUs known: a no-op, whatever the pid
    assert affinity(0) == HOST


def _tree(code: str) -> subprocess.Popen:
    """A Python parent running ``code``, which starts children of its own."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.DEVNULL)


def _kill_trees(*trees: subprocess.Popen) -> None:
    for p in trees:
        for pid in descendants(p.pid):
            os.kill(pid, 9)
        p.kill()
        p.wait()


@two_cpus
def test_a_real_engine_binding_is_found_and_a_real_tree_moved_off_it():
    first = min(HOST)
    engine = _tree(f"""
        import os, subprocess, time
        subprocess.Popen(["sleep", "60"], preexec_fn=lambda: os.sched_setaffinity(0, {{{first}}}))
        time.sleep(60)
    """)
    other = _tree("""
        import subprocess, threading, time
        subprocess.Popen(["sleep", "60"])
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
        time.sleep(60)
    """)
    try:
        wait_until(lambda: descendants(engine.pid) and descendants(other.pid), 10, "both trees' children")
        wait_until(lambda: len(os.listdir(f"/proc/{other.pid}/task")) == 2, 10, "the other tree's thread")
        placement = Placement(HOST)
        assert placement.learn([engine.pid]) == HOST - {first}
        placement.apply([other.pid])
        for pid in (other.pid, *descendants(other.pid)):
            for tid in os.listdir(f"/proc/{pid}/task"):
                assert affinity(int(tid)) == HOST - {first}, (pid, tid)
        assert affinity(engine.pid) == HOST  # the engine's own tree is not touched
        assert placement.apply_front_end(engine.pid)  # the inference worker's own process: moved
        assert {affinity(int(t)) for t in os.listdir(f"/proc/{engine.pid}/task")} == {HOST - {first}}
        assert [affinity(pid) for pid in descendants(engine.pid)] == [{first}]  # its engine stays bound
    finally:
        _kill_trees(engine, other)


@two_cpus
def test_a_child_is_placed_as_it_starts_so_its_own_children_inherit(tmp_path: Path):
    sup = Supervisor(tmp_path, echo=False)
    placement = Placement(HOST)
    placement.cpus = frozenset({max(HOST)})
    sup.on_start = lambda child: placement.apply([child.proc.pid])
    child = sup.spawn("stage", [sys.executable, "-c", "import subprocess; subprocess.run(['sleep', '60'])"], dict(os.environ))
    try:
        wait_until(lambda: descendants(child.proc.pid), 10, "the child's own child")
        assert affinity(child.proc.pid) == {max(HOST)}
        assert all(affinity(pid) == {max(HOST)} for pid in descendants(child.proc.pid))
    finally:
        sup.stop(timeout=5)


def _threads_of(pid: int) -> set[tuple[frozenset[int], int]]:
    """Each thread's CPUs and niceness."""
    return {(affinity(int(t)), os.getpriority(os.PRIO_PROCESS, int(t))) for t in os.listdir(f"/proc/{pid}/task")}


@two_cpus
def test_a_watcher_goes_onto_the_engine_cpus_below_them_and_a_pipeline_puts_flower_there(tmp_path: Path):
    """Flower watches, and no request waits for it: it leaves the free CPUs to the stages."""
    first = min(HOST)
    flower = _tree("""
        import subprocess, threading, time
        subprocess.Popen(["sleep", "60"])
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
        time.sleep(60)
    """)
    stage = _tree("import time; time.sleep(60)")
    try:
        wait_until(lambda: descendants(flower.pid), 10, "the watcher's child")
        wait_until(lambda: len(os.listdir(f"/proc/{flower.pid}/task")) == 2, 10, "the watcher's thread")
        placement = Placement(HOST)
        placement.apply_watcher(flower.pid)  # nothing learned yet: nothing moves
        assert _threads_of(flower.pid) == {(HOST, 0)}
        placement.cpus = HOST - {first}
        assert placement.engine == {first}
        lp = LocalPipeline(Settings(state_dir=tmp_path), kinds=(), api=False)
        lp.placement = placement
        lp._place_child(SimpleNamespace(name=FLOWER, proc=flower))  # Flower (re)started
        lp._place_child(SimpleNamespace(name="api", proc=stage))  # any other child
        for pid in (flower.pid, *descendants(flower.pid)):
            assert _threads_of(pid) == {(frozenset({first}), WATCHER_NICE)}, pid
        assert _threads_of(stage.pid) == {(HOST - {first}, 0)}
    finally:
        _kill_trees(flower, stage)


def test_pin_counts_the_threads_it_bound():
    assert pin(os.getpid(), HOST) >= 1  # this process, on all it may use: nothing changes
    assert affinity(0) == HOST


def test_a_local_pipeline_places_only_where_affinity_is_supported_and_asked_for(monkeypatch, tmp_path):
    assert supported()  # Linux
    assert LocalPipeline(Settings(state_dir=tmp_path), api=False).placement is not None
    assert LocalPipeline(Settings(state_dir=tmp_path, isolate_engine_cpus=False), api=False).placement is None
    monkeypatch.setattr(local_pipeline, "placement_supported", lambda: False)  # not Linux
    lp = LocalPipeline(Settings(state_dir=tmp_path), api=False)
    assert lp.placement is None
    lp.place(os.getpid())  # a no-op


@two_cpus
def test_a_front_end_moves_only_once_its_engine_has_bound_its_cpus():
    """vLLM's binding reads the CPUs its process may use when the engine starts: an inference
    worker moved before that would hand its engine the free CPUs instead of its own."""
    first = min(HOST)
    worker = _tree("""
        import subprocess, time
        subprocess.Popen(["sleep", "60"])  # an engine that has not bound its CPUs yet
        time.sleep(60)
    """)
    try:
        wait_until(lambda: descendants(worker.pid), 10, "the worker's engine")
        placement = Placement(HOST)
        placement.cpus = HOST - {first}
        assert not placement.apply_front_end(worker.pid)
        assert affinity(worker.pid) == HOST
        [engine] = descendants(worker.pid)
        os.sched_setaffinity(engine, {first})  # vLLM binds its forward passes
        assert placement.apply_front_end(worker.pid)
        assert affinity(worker.pid) == HOST - {first} and affinity(engine) == {first}
    finally:
        _kill_trees(worker)


def test_following_a_restarted_front_end_polls_until_its_engine_binds_or_time_is_up():
    placement = Placement(frozenset({0, 1}))
    placement.cpus = frozenset({1})
    now = [0.0]
    binds_after = [2]  # polls before the engine has bound its CPUs

    def apply_front_end(pid: int, **_) -> bool:
        binds_after[0] -= 1
        return binds_after[0] < 0

    placement.apply_front_end = apply_front_end  # the probe; the loop is what is tested here
    sleep = lambda s: now.__setitem__(0, now[0] + s)  # noqa: E731
    assert placement.follow_front_end(1, lambda: True, timeout_s=10, clock=lambda: now[0], sleep=sleep)
    assert now[0] == 1.0  # two polls of 0.5 s, then it moved
    binds_after[0] = 100
    now[0] = 0.0
    assert not placement.follow_front_end(1, lambda: True, timeout_s=10, clock=lambda: now[0], sleep=sleep)
    assert now[0] == 10.0
    assert not placement.follow_front_end(1, lambda: False, timeout_s=10, clock=lambda: now[0], sleep=sleep)
