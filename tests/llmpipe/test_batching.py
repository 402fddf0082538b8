import threading

import pytest

from llmpipe.batching import Batcher, BatchWindow


class FakeClock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def test_window_not_ready_at_49ms_ready_at_50ms():
    clock = FakeClock()
    w = BatchWindow(window_s=0.050, max_size=8, clock=clock)
    w.open()
    clock.advance(0.049)
    assert not w.ready(3)
    clock.advance(0.001)
    assert w.ready(3)


def test_full_batch_flushes_at_once():
    clock = FakeClock()
    w = BatchWindow(window_s=0.050, max_size=4, clock=clock)
    w.open()
    assert not w.ready(3)
    assert w.ready(4)
    assert w.ready(5)


def test_window_counts_from_first_request_not_from_latest():
    clock = FakeClock()
    w = BatchWindow(window_s=0.050, max_size=8, clock=clock)
    w.open()
    clock.advance(0.030)
    w.open()  # a second request arrives; the window must not restart
    clock.advance(0.020)
    assert w.ready(2)


def test_lone_request_does_not_wait_when_no_company_is_expected():
    clock = FakeClock()
    w = BatchWindow(window_s=0.050, max_size=8, clock=clock)
    w.open()
    assert w.ready(1, company_expected=False)
    assert not w.ready(1, company_expected=True)
    assert not w.ready(0, company_expected=False)


def test_remaining_and_explicit_now():
    w = BatchWindow(window_s=0.050, max_size=8, clock=FakeClock(0.0))
    w.open(now=10.0)
    assert w.remaining(now=10.020) == pytest.approx(0.030)
    assert w.ready(2, now=10.050)
    assert not w.ready(2, now=10.0499)


def test_invalid_max_size():
    with pytest.raises(ValueError):
        BatchWindow(0.05, 0)


def _gated_runner(gate: threading.Event, seen: list):
    def run(items):
        gate.wait(5)
        seen.append(list(items))
        return [i * 10 for i in items]

    return run


def test_batcher_gathers_requests_while_engine_busy():
    gate = threading.Event()
    seen: list = []
    b = Batcher(_gated_runner(gate, seen), window_s=10.0, max_size=8, company_expected=lambda: False)
    first = b.submit(1)  # runs alone (no company) and blocks on the gate
    # wait until the first batch is taken
    for _ in range(200):
        if b.pending() == 0:
            break
        threading.Event().wait(0.005)
    futs = [b.submit(i) for i in range(2, 6)]
    gate.set()
    assert first.result(5) == 10
    assert [f.result(5) for f in futs] == [20, 30, 40, 50]
    assert seen[0] == [1]
    assert seen[1] == [2, 3, 4, 5]  # gathered while the engine was busy
    assert b.stats.batch_sizes == [1, 4]
    b.stop()


def test_batcher_caps_batches_at_max_size():
    gate = threading.Event()
    seen: list = []
    b = Batcher(_gated_runner(gate, seen), window_s=10.0, max_size=3, company_expected=lambda: False)
    b.submit(0)
    for _ in range(200):
        if b.pending() == 0:
            break
        threading.Event().wait(0.005)
    futs = [b.submit(i) for i in range(1, 8)]
    gate.set()
    assert [f.result(5) for f in futs] == [i * 10 for i in range(1, 8)]
    assert all(len(batch) <= 3 for batch in seen)
    assert sum(len(batch) for batch in seen) == 8
    b.stop()


def test_batcher_per_item_exception_and_batch_exception():
    def run(items):
        if "boom" in items:
            raise RuntimeError("batch broke")
        return [ValueError("bad") if i == "bad" else i.upper() for i in items]

    b = Batcher(run, window_s=0.0, max_size=1, company_expected=lambda: False)
    assert b.submit("ok").result(5) == "OK"
    with pytest.raises(ValueError):
        b.submit("bad").result(5)
    with pytest.raises(RuntimeError, match="batch broke"):
        b.submit("boom").result(5)
    b.stop()


def test_batcher_rejects_after_stop():
    b = Batcher(lambda items: items, window_s=0.0, max_size=1)
    b.stop()
    with pytest.raises(RuntimeError):
        b.submit(1)


def test_failing_company_probe_does_not_stall():
    def probe():
        raise ConnectionError("redis down")

    b = Batcher(lambda items: items, window_s=0.01, max_size=4, company_expected=probe)
    assert b.submit(7).result(5) == 7
    b.stop()


def test_submit_never_waits_on_the_company_probe():
    """The probe is a Redis round trip (LLEN): the batcher must not hold its lock across it."""
    probing = threading.Event()
    release = threading.Event()

    def slow_probe():
        probing.set()
        release.wait(10)
        return True

    b = Batcher(lambda items: items, window_s=30.0, max_size=8, company_expected=slow_probe)
    try:
        b.submit("first")
        assert probing.wait(5), "the batcher never probed"
        done = threading.Event()
        threading.Thread(target=lambda: (b.submit("second"), done.set()), daemon=True).start()
        assert done.wait(5), "submit() waited for the probe"
        assert not release.is_set()  # the probe was still in flight the whole time
    finally:
        release.set()
        b.stop()
