"""llmpipe/observability/heap.py: what a long-lived process builds at start is frozen, so no collection
walks it again (and exit skips its final sweep)."""

from __future__ import annotations

import gc
import weakref

import pytest


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


@pytest.fixture
def unfrozen():
    gc.collect()
    gc.unfreeze()  # this test process's own heap goes back to being collected
    yield
    gc.unfreeze()


def test_a_cycle_alive_at_the_freeze_is_never_collected_one_made_after_is(unfrozen):
    from llmpipe.observability.heap import freeze_heap

    before = Node()
    frozen = freeze_heap()
    assert frozen >= 1
    after = Node()
    before_ref, after_ref = weakref.ref(before), weakref.ref(after)
    del before, after

    gc.collect()

    assert after_ref() is None  # built after start-up: collected as always
    assert before_ref() is not None  # in the start-up heap: a full collection left it alone
    gc.unfreeze()
    gc.collect()
    assert before_ref() is None


def test_freezing_again_takes_in_what_was_built_since(unfrozen):
    from llmpipe.observability.heap import freeze_heap

    first = freeze_heap()
    kept = [Node() for _ in range(100)]
    assert freeze_heap() >= first + len(kept)


def _receivers(signal) -> list:
    return [r() if isinstance(r, weakref.ref) else r for _, r in signal.receivers]


def test_a_worker_freezes_its_heap_after_warming_and_the_served_app_too(unfrozen, monkeypatch):
    # The worker's hook runs on worker_init (before the prefork pool forks) and on
    # worker_ready (after the engine loaded), after the warm-ups; the API's server factory
    # freezes once the app is built, and an app built for a test freezes nothing.
    from celery.signals import worker_init, worker_ready

    from workers import signals

    for signal, warm in ((worker_init, signals._warm_cpu_stage), (worker_ready, signals._warm)):
        hooks = _receivers(signal)
        assert hooks.index(signals._freeze_startup_heap) > hooks.index(warm)
    signals._freeze_startup_heap()
    assert gc.get_freeze_count() > 0

    gc.unfreeze()
    import api.app

    monkeypatch.setattr(api.app, "create_app", lambda: "app")
    assert api.app.serve_app() == "app"
    assert gc.get_freeze_count() > 0


@pytest.mark.parametrize("enabled", [True, False])
def test_no_collection_inside_collector_paused_and_the_collector_as_it_was_after(enabled):
    from llmpipe.observability.heap import collector_paused

    (gc.enable if enabled else gc.disable)()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert gc.isenabled() is enabled
        with pytest.raises(RuntimeError), collector_paused():
            raise RuntimeError("a failed start")
        assert gc.isenabled() is enabled
    finally:
        gc.enable()

