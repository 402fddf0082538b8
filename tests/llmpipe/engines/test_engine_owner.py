from __future__ import annotations

import threading

import pytest

from llmpipe.engines.noop import NoopEngine
from llmpipe.engines.owner import EngineOwner
from llmpipe.errors import EngineDeadError


class CountingEngine(NoopEngine):
    def __init__(self) -> None:
        super().__init__()
        self.shutdowns = 0

    def shutdown(self) -> None:
        self.shutdowns += 1


def test_lazy_and_once():
    made: list[CountingEngine] = []

    def factory():
        made.append(CountingEngine())
        return made[-1]

    owner = EngineOwner(factory)
    assert not owner.loaded and made == []
    e = owner.get()
    assert owner.loaded and owner.get() is e and made == [e]


def test_concurrent_get_waits_for_one_load():
    release = threading.Event()
    entered = threading.Event()
    calls = []

    def factory():
        calls.append(1)
        entered.set()
        assert release.wait(10)
        return CountingEngine()

    owner = EngineOwner(factory)
    results: list[object] = []
    threads = [threading.Thread(target=lambda: results.append(owner.get())) for _ in range(8)]
    for t in threads:
        t.start()
    assert entered.wait(10)
    assert not owner.loaded
    release.set()
    for t in threads:
        t.join(10)
    assert len(calls) == 1
    assert len(results) == 8 and all(r is results[0] for r in results)


def test_failed_load_raises_same_error_to_waiters_then_retries():
    release = threading.Event()
    entered = threading.Event()
    attempts = []
    boom = RuntimeError("no model")

    def factory():
        attempts.append(1)
        if len(attempts) == 1:
            entered.set()
            assert release.wait(10)
            raise boom
        return CountingEngine()

    owner = EngineOwner(factory)
    errors: list[BaseException] = []

    def call():
        try:
            owner.get()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(4)]
    threads[0].start()
    assert entered.wait(10)
    for t in threads[1:]:
        t.start()
    release.set()
    for t in threads:
        t.join(10)
    assert len(attempts) == 1
    assert len(errors) == 4 and all(e is boom for e in errors)
    assert not owner.loaded
    e = owner.get()  # retried
    assert owner.loaded and len(attempts) == 2 and isinstance(e, CountingEngine)


def test_shutdown_once_and_idempotent():
    engine = CountingEngine()
    owner = EngineOwner(lambda: engine)
    owner.shutdown()  # never loaded: nothing to do
    assert engine.shutdowns == 0

    owner = EngineOwner(lambda: engine)
    owner.get()
    owner.shutdown()
    owner.shutdown()
    assert engine.shutdowns == 1
    assert not owner.loaded
    with pytest.raises(EngineDeadError):
        owner.get()
