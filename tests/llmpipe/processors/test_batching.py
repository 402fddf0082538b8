import threading

import pytest

from llmpipe.processors.batching import Batcher, BatchWindow
from tests.harness.clock import ManualClock


class Recorder:
    """A run_batch that records each batch it is handed, then (``hold``) waits for ``release``."""

    def __init__(self, hold: bool = True):
        self.cond = threading.Condition()
        self.seen: list[list[int]] = []
        self.release = threading.Event()
        self.hold = hold

    def run(self, items):
        with self.cond:
            self.seen.append(list(items))
            self.cond.notify_all()
        if self.hold:
            self.release.wait(5)
        return list(items)

    def batches(self, n: int) -> bool:
        """Whether the n-th batch came within 5 s."""
        with self.cond:
            return self.cond.wait_for(lambda: len(self.seen) == n, timeout=5)


def test_window_not_ready_at_49ms_ready_at_50ms():
    clock = ManualClock(100.0)
    w = BatchWindow(window_s=0.050, max_size=8, clock=clock)
    w.open()
    clock.advance(0.049)
    assert not w.ready(3)
    clock.advance(0.001)
    assert w.ready(3)


def test_full_batch_flushes_at_once():
    clock = ManualClock(100.0)
    w = BatchWindow(window_s=0.050, max_size=4, clock=clock)
    w.open()
    assert not w.ready(3)
    assert w.ready(4)
    assert w.ready(5)


def test_window_counts_from_first_request_not_from_latest():
    clock = ManualClock(100.0)
    w = BatchWindow(window_s=0.050, max_size=8, clock=clock)
    w.open()
    clock.advance(0.030)
    w.open()  # a second request arrives; the window must not restart
    clock.advance(0.020)
    assert w.ready(2)


def test_lone_request_does_not_wait_when_no_company_is_expected():
    clock = ManualClock(100.0)
    w = BatchWindow(window_s=0.050, max_size=8, clock=clock)
    w.open()
    assert w.ready(1, company_expected=False)
    assert not w.ready(1, company_expected=True)
    assert not w.ready(0, company_expected=False)


def test_remaining_and_explicit_now():
    w = BatchWindow(window_s=0.050, max_size=8, clock=ManualClock(0.0))
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


def test_capped_items_hold_at_most_cap_engine_slots_while_uncapped_ones_pass_them():
    """The batch lane's share of a continuous engine: items >= 100 are capped at 2 in flight;
    an uncapped (interactive) item goes to the engine at once, past the capped ones waiting."""
    release = threading.Event()
    cond = threading.Condition()
    seen: list[list[int]] = []
    in_flight = {"capped": 0, "max": 0}

    def run(items):
        capped = sum(1 for i in items if i >= 100)
        with cond:
            seen.append(list(items))
            in_flight["capped"] += capped
            in_flight["max"] = max(in_flight["max"], in_flight["capped"])
            cond.notify_all()
        release.wait(5)
        with cond:
            in_flight["capped"] -= capped
        return list(items)

    b = Batcher(run, window_s=0.0, max_size=8, concurrent_batches=8, company_expected=lambda: False,
                order=lambda i: 0 if i < 100 else 10, capped=lambda i: i >= 100, cap=2)
    try:
        batch_futs = [b.submit(i) for i in range(100, 105)]
        with cond:
            assert cond.wait_for(lambda: len(seen) == 1, timeout=5)
        inter = b.submit(1)
        with cond:
            assert cond.wait_for(lambda: len(seen) == 2, timeout=5)
        assert seen == [[100, 101], [1]]
        assert b.pending() == 3  # held back by the cap, not by the engine
        release.set()
        assert inter.result(5) == 1
        assert [f.result(5) for f in batch_futs] == list(range(100, 105))
        assert in_flight["max"] == 2
        assert sorted(i for batch in seen for i in batch) == [1, *range(100, 105)]
    finally:
        release.set()
        b.stop()


def test_cap_needs_its_predicate():
    with pytest.raises(ValueError):
        Batcher(lambda items: items, window_s=0.0, max_size=4, cap=2)
    with pytest.raises(ValueError):
        Batcher(lambda items: items, window_s=0.0, max_size=4, capped=lambda i: True, cap=0)


def test_capped_items_start_one_at_a_time_while_the_cap_holds():
    """starting_cap 1: the next capped item goes to the engine only at the first output of
    the one before (started), or when its batch returns; uncapped items never wait for it."""
    e = Recorder()
    b = Batcher(e.run, window_s=0.0, max_size=8, concurrent_batches=8, company_expected=lambda: False,
                order=lambda i: 0 if i < 100 else 10, capped=lambda i: i >= 100, cap=3, starting_cap=1,
                key=lambda i: f"r{i}")
    try:
        inter = b.submit(1)  # no cap_hold_s: the cap always holds
        assert e.batches(1)
        futs = [b.submit(i) for i in range(100, 104)]
        assert e.batches(2)
        assert e.seen == [[1], [100]] and b.pending() == 3
        b.submit(2)
        assert e.batches(3)
        assert e.seen[2] == [2]  # an interactive item passes the starting one
        b.started("r1")  # not a capped item's key: nothing moves
        b.started("r100")
        assert e.batches(4)
        assert e.seen[3] == [101] and b.pending() == 2
        b.started("r101")
        b.started("r102")  # before it was sent: counts for nothing
        assert e.batches(5)
        assert e.seen[4] == [102] and b.pending() == 1  # 103 waits on 102 and on the cap of 3
        b.started("r102")
        assert b.pending() == 1  # three capped items run: the cap holds it
        e.release.set()
        assert inter.result(5) == 1 and [f.result(5) for f in futs] == list(range(100, 104))
        assert e.seen[5] == [103]
    finally:
        e.release.set()
        b.stop()


def test_a_returned_batch_frees_its_starting_items():
    """An item that never produced (cancelled, failed) stops counting as starting when its
    batch returns."""
    e = Recorder(hold=False)
    b = Batcher(e.run, window_s=0.0, max_size=8, concurrent_batches=8, company_expected=lambda: False,
                order=lambda i: 0 if i < 100 else 10, capped=lambda i: i >= 100, cap=4, starting_cap=1)
    try:
        futs = [b.submit(i) for i in range(100, 103)]
        assert [f.result(5) for f in futs] == [100, 101, 102]
        assert e.seen == [[100], [101], [102]]
    finally:
        b.stop()


def test_starting_cap_needs_a_cap():
    with pytest.raises(ValueError):
        Batcher(lambda items: items, window_s=0.0, max_size=4, starting_cap=1)
    with pytest.raises(ValueError):
        Batcher(lambda items: items, window_s=0.0, max_size=4, capped=lambda i: True, cap=2, starting_cap=0)


def test_the_cap_holds_only_while_uncapped_items_came_recently():
    """Work-conserving slot share: with no interactive item in cap_hold_s, capped items use
    every slot; an interactive one brings the cap back for cap_hold_s (fake clock)."""
    clock = ManualClock(100.0)
    release = threading.Event()
    cond = threading.Condition()
    seen: list[list[int]] = []
    expect = {"company": False}

    def run(items):
        with cond:
            seen.append(list(items))
            cond.notify_all()
        release.wait(5)
        return list(items)

    b = Batcher(run, window_s=0.2, max_size=8, concurrent_batches=8, company_expected=lambda: expect["company"],
                order=lambda i: 0 if i < 100 else 10, capped=lambda i: i >= 100, cap=2, cap_hold_s=30.0,
                clock=clock)
    try:
        futs = [b.submit(i) for i in range(100, 104)]  # batch-only: the cap does not hold
        with cond:
            assert cond.wait_for(lambda: len(seen) == 1, timeout=5)
        assert seen[0] == [100, 101, 102, 103]
        # The window keeps the next batch open until all three wait; the interactive item
        # brings the cap back, and 4 capped items already run (cap 2): only it goes.
        expect["company"] = True
        futs += [b.submit(1), b.submit(104), b.submit(105)]
        clock.advance(0.2)
        with cond:
            assert cond.wait_for(lambda: len(seen) == 2, timeout=5)
        assert seen[1] == [1] and b.pending() == 2
        # No interactive item for cap_hold_s: the cap lifts, the next wake-up takes them all.
        clock.advance(30.0)
        futs.append(b.submit(106))
        with cond:
            assert cond.wait_for(lambda: len(seen) == 3, timeout=5)
        assert seen[2] == [104, 105, 106]
        release.set()
        assert [f.result(5) for f in futs] == [*range(100, 104), 1, 104, 105, 106]
    finally:
        release.set()
        b.stop()


def test_while_the_cap_holds_the_window_waits_only_for_uncapped_company():
    """Batch-lane messages waiting in the broker enter through the cap one by one: an
    interactive item does not wait out the window for them. A batch-only load still waits
    for any company (fake clock: the window passes only when the test moves it)."""
    clock = ManualClock(100.0)
    probes = Probes()
    rec = Recorder(hold=False)
    b = Batcher(rec.run, window_s=0.05, max_size=8, concurrent_batches=8, company_expected=probes.of("any", True),
                uncapped_company=probes.of("uncapped", False), capped=lambda i: i >= 100, cap=1, cap_hold_s=30.0,
                clock=clock)
    try:
        b.submit(100)  # batch-only: the cap does not hold, and any company is waited for
        assert probes.made("any", 2) and rec.seen == []  # probed again after a wait: still waiting
        clock.advance(0.05)
        assert rec.batches(1) and rec.seen[0] == [100]
        assert b.submit(1).result(5) == 1  # the cap holds: no interactive company, so at once
        assert rec.seen[1] == [1] and probes.calls[-1] == "uncapped"
    finally:
        b.stop()


def test_without_an_uncapped_probe_the_window_waits_for_any_company():
    clock = ManualClock(100.0)
    probes = Probes()
    rec = Recorder(hold=False)
    b = Batcher(rec.run, window_s=0.05, max_size=8, concurrent_batches=8, company_expected=probes.of("any", True),
                capped=lambda i: i >= 100, cap=1, cap_hold_s=30.0, clock=clock)
    try:
        fut = b.submit(1)
        assert probes.made("any", 2) and rec.seen == []
        clock.advance(0.05)
        assert fut.result(5) == 1
    finally:
        b.stop()


class Probes:
    """Company probes that record each call by name."""

    def __init__(self):
        self.cond = threading.Condition()
        self.calls: list[str] = []

    def of(self, name: str, answer: bool):
        def probe() -> bool:
            with self.cond:
                self.calls.append(name)
                self.cond.notify_all()
            return answer
        return probe

    def made(self, name: str, n: int) -> bool:
        """Whether ``name`` was probed ``n`` times within 5 s."""
        with self.cond:
            return self.cond.wait_for(lambda: self.calls.count(name) >= n, timeout=5)
