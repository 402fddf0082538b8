"""Dynamic batching inside the inference worker process.

Celery hands each inference message to a pool thread (a plain task, so chains, chords,
events, acks_late and redelivery keep working). The thread submits its request here
and waits on a future; one batcher thread forms batches and hands them to the engine.

The window opens at the first request of a batch and closes after ``window_s`` or at
``max_size`` requests. It also closes at once when no company is expected (nothing else
waits in the broker queue), so a lone request at idle never waits out the window.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
Clock = Callable[[], float]


class BatchWindow:
    """When a forming batch is ready to run. Pure logic with an injectable clock."""

    def __init__(self, window_s: float, max_size: int, clock: Clock = time.monotonic):
        if max_size < 1:
            raise ValueError("max_size must be >= 1")
        self.window_s = window_s
        self.max_size = max_size
        self._clock = clock
        self.opened_at: float | None = None

    def open(self, now: float | None = None) -> None:
        if self.opened_at is None:
            if now is None:
                now = self._clock()
            self.opened_at = now

    def close(self) -> None:
        self.opened_at = None

    def ready(self, size: int, now: float | None = None, company_expected: bool = True) -> bool:
        if size <= 0:
            return False
        if size >= self.max_size or not company_expected:
            return True
        if self.opened_at is None:
            return False
        if now is None:
            now = self._clock()
        # A small epsilon so that float arithmetic never keeps a due window open.
        return now - self.opened_at >= self.window_s - 1e-9

    def remaining(self, now: float | None = None) -> float:
        if self.opened_at is None:
            return self.window_s
        if now is None:
            now = self._clock()
        return max(0.0, self.window_s - (now - self.opened_at))


@dataclass
class _Pending(Generic[T]):
    item: T
    future: Future
    arrived: float = 0.0


@dataclass
class BatchStats:
    """What the batcher saw, for metrics and tests."""

    batch_sizes: list[int] = field(default_factory=list)
    batch_waits_s: list[float] = field(default_factory=list)

    def record(self, size: int, wait_s: float) -> None:
        # Bounded so a long-running worker does not grow without limit.
        if len(self.batch_sizes) >= 10_000:
            del self.batch_sizes[:5_000]
            del self.batch_waits_s[:5_000]
        self.batch_sizes.append(size)
        self.batch_waits_s.append(wait_s)


BatchFn = Callable[[list[Any]], list[Any]]


class Batcher(Generic[T]):
    """Collects submitted items into batches and runs ``run_batch`` on each.

    ``run_batch`` returns one result per item, in order; an item's result may be an
    Exception instance, which is set on that item's future alone. If ``run_batch``
    raises, every future of the batch gets the exception.

    With ``concurrent_batches > 1`` (engines with continuous batching) a new batch is
    dispatched while earlier ones still run, so requests join the running engine batch.
    Otherwise batches run one at a time and requests gather while the engine is busy.

    ``capped`` and ``cap``: at most ``cap`` items for which ``capped(item)`` is true are in
    the engine at once (dispatched, their batch not yet returned); the others wait here,
    behind nothing, while uncapped items pass them. The batch lane's share of the engine's
    running slots (vLLM's ``max_num_seqs``), so an interactive request finds a free slot and
    shares its steps with fewer batch requests: vLLM admits by priority but never preempts a
    running request for a waiting one while the KV cache has room (llmpipe/jobs/lanes.py).
    With ``cap_hold_s`` the cap holds only for that long after the last uncapped item came:
    a batch-only load keeps every slot (work-conserving), and the first interactive request
    after a quiet spell brings the cap back as the running batch requests finish.

    ``starting_cap``: while the cap holds, at most that many capped items are starting at
    once: dispatched, and neither ``started(key(item))`` (the engine's first output for it:
    its prefill is done) nor their batch returned. The batch lane's prefills then go through
    the engine a few at a time. Without it, the batch requests that fill the cap together
    also end together (same length), and the next ones prefill together, in the step that
    an interactive request arriving then shares (docs/benchmarks.md "The Batch API").

    ``uncapped_company``: while the cap holds, the window waits only for company this probe
    expects (uncapped items waiting in the broker), not for ``company_expected``'s: capped
    items waiting there join a batch one by one through the cap, so an uncapped item that
    waited out the window for them would wait for nothing.
    """

    def __init__(
        self,
        run_batch: BatchFn,
        *,
        window_s: float,
        max_size: int,
        concurrent_batches: int = 1,
        company_expected: Callable[[], bool] | None = None,
        uncapped_company: Callable[[], bool] | None = None,
        on_batch: Callable[[int, float], None] | None = None,
        clock: Clock = time.monotonic,
        order: Callable[[T], Any] | None = None,
        capped: Callable[[T], bool] | None = None,
        cap: int | None = None,
        cap_hold_s: float | None = None,
        starting_cap: int | None = None,
        key: Callable[[T], Hashable] = id,
    ):
        self._run_batch = run_batch
        self._window = BatchWindow(window_s, max_size, clock)
        self._clock = clock
        self._company_expected = company_expected or (lambda: True)
        self._uncapped_company = uncapped_company
        self._on_batch = on_batch
        # A batch takes the pending items with the smallest keys first, arrival order among
        # equals (vLLM's priority: the interactive lane before a batch backlog).
        self._order = order
        if (capped is None) != (cap is None) or (cap is not None and cap < 1):
            raise ValueError("capped and cap go together, and cap must be >= 1")
        self._capped = capped
        self._cap = cap
        self._capped_in_flight = 0
        self._cap_hold_s = cap_hold_s
        self._uncapped_at: float | None = None  # when the last uncapped item was submitted
        if starting_cap is not None and (cap is None or starting_cap < 1):
            raise ValueError("starting_cap needs a cap, and must be >= 1")
        self._starting_cap = starting_cap
        self._key = key
        self._starting: set[Hashable] = set()  # capped items dispatched, not started yet
        self._cond = threading.Condition()
        self._pending: list[_Pending[T]] = []
        self._stopping = False
        self.concurrent_batches = max(1, concurrent_batches)
        self._slots = threading.BoundedSemaphore(self.concurrent_batches)
        self._pool = ThreadPoolExecutor(max_workers=max(1, concurrent_batches), thread_name_prefix="llmpipe-batch")
        self.stats = BatchStats()
        self._thread = threading.Thread(target=self._loop, name="llmpipe-batcher", daemon=True)
        self._thread.start()

    @property
    def max_size(self) -> int:
        return self._window.max_size

    def submit(self, item: T) -> Future:
        fut: Future = Future()
        with self._cond:
            if self._stopping:
                raise RuntimeError("batcher is stopped")
            now = self._clock()
            if not self._pending:
                self._window.open(now)
            self._pending.append(_Pending(item, fut, now))
            if self._capped is not None and not self._capped(item):
                self._uncapped_at = now
            self._cond.notify_all()
        return fut

    def started(self, key: Hashable) -> None:
        """The engine's first output for the item of ``key``: it no longer counts as starting."""
        if self._starting_cap is None:  # nothing is counted: no lock on the engine's thread
            return
        with self._cond:
            if key in self._starting:
                self._starting.discard(key)
                self._cond.notify_all()

    @property
    def running(self) -> bool:
        return not self._stopping

    def pending(self) -> int:
        with self._cond:
            return len(self._pending)

    def stop(self, wait: bool = True) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=5 if wait else 0)
        self._pool.shutdown(wait=wait)

    def _expect_company(self, uncapped_only: bool = False) -> bool:
        probe = self._uncapped_company if uncapped_only and self._uncapped_company is not None else self._company_expected
        try:
            return bool(probe())
        except Exception:  # a failing probe must not stall batching; assume company
            log.debug("company_expected probe failed", exc_info=True)
            return True

    def _is_capped(self, p: _Pending[T]) -> bool:
        return self._capped is not None and bool(self._capped(p.item))

    def _cap_holds(self, now: float | None = None) -> bool:
        if self._capped is None or self._stopping:
            return False
        if self._cap_hold_s is None:
            return True
        if self._uncapped_at is None:
            return False
        if now is None:
            now = self._clock()
        return now - self._uncapped_at < self._cap_hold_s

    def _cap_lifts_in(self) -> float | None:
        """Seconds until the cap stops holding by itself (None: only a returning batch frees it)."""
        if self._cap_hold_s is None or self._uncapped_at is None:
            return None
        return max(0.0, self._uncapped_at + self._cap_hold_s - self._clock())

    def _capped_room(self) -> int:
        """How many more capped items may go to the engine while the cap holds."""
        room = max(0, self._cap - self._capped_in_flight)
        if self._starting_cap is not None:
            room = min(room, max(0, self._starting_cap - len(self._starting)))
        return room

    def _eligible(self) -> int:
        """How many pending items may go to the engine now (the cap holds the rest back)."""
        if not self._cap_holds():
            return len(self._pending)
        capped = sum(1 for p in self._pending if self._is_capped(p))
        return len(self._pending) - capped + min(capped, self._capped_room())

    def _take_batch(self) -> list[_Pending[T]] | None:
        with self._cond:
            while True:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                if self._stopping and not self._pending:
                    return None
                size = self._eligible()
                if size == 0:  # only capped items, and the cap is full: wait for a batch to return
                    self._cond.wait(timeout=self._cap_lifts_in())
                    continue
                if self._stopping or self._window.ready(size):  # full, or the window has passed
                    break
                # The probe is a network round trip (EXISTS): made without the lock, so that
                # submit() never waits on Redis.
                uncapped_only = self._cap_holds()
                self._cond.release()
                try:
                    expected = self._expect_company(uncapped_only)
                finally:
                    self._cond.acquire()
                size = self._eligible()
                if self._stopping or self._window.ready(size, company_expected=expected and size < self._window.max_size):
                    break
                self._cond.wait(timeout=self._window.remaining())
            if self._order is not None and (len(self._pending) > self._window.max_size or self._capped is not None):
                self._pending.sort(key=lambda p: self._order(p.item))  # stable: arrival order among equals
            batch = self._select()
            self._window.close()
            if self._pending:
                self._window.open(min(p.arrived for p in self._pending))
            return batch

    def _select(self) -> list[_Pending[T]]:
        """Takes the batch out of the pending items, in their order, within the cap."""
        m = self._window.max_size
        if not self._cap_holds():
            batch = self._pending[:m]
            del self._pending[:m]
        else:
            batch = self._select_within_cap(m)
        if self._capped is not None:
            capped = [p for p in batch if self._is_capped(p)]
            self._capped_in_flight += len(capped)
            if self._starting_cap is not None:
                self._starting.update(self._key(p.item) for p in capped)
        return batch

    def _select_within_cap(self, m: int) -> list[_Pending[T]]:
        room = self._capped_room()
        batch, rest = [], []
        for p in self._pending:
            if len(batch) >= m:
                rest.append(p)
            elif self._is_capped(p):
                if room > 0:
                    room -= 1
                    batch.append(p)
                else:
                    rest.append(p)
            else:
                batch.append(p)
        self._pending = rest
        return batch

    def _loop(self) -> None:
        while True:
            # Wait for a free engine slot before forming the batch, so requests keep
            # gathering while a non-continuous engine is busy.
            self._slots.acquire()
            batch = self._take_batch()
            if batch is None:
                self._slots.release()
                return
            wait_s = self._clock() - batch[0].arrived
            self.stats.record(len(batch), wait_s)
            if self._on_batch is not None:
                self._on_batch(len(batch), wait_s)
            self._pool.submit(self._execute, batch)

    def _execute(self, batch: list[_Pending[T]]) -> None:
        try:
            try:
                results = self._run_batch([p.item for p in batch])
                if len(results) != len(batch):
                    raise RuntimeError(f"run_batch returned {len(results)} results for {len(batch)} items")
            except BaseException as exc:  # every waiter must hear about the failure
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(exc)
                return
            for p, r in zip(batch, results, strict=True):
                if isinstance(r, BaseException):
                    p.future.set_exception(r)
                else:
                    p.future.set_result(r)
        finally:
            if self._capped is not None:
                with self._cond:
                    capped = [p for p in batch if self._is_capped(p)]
                    self._capped_in_flight -= len(capped)
                    self._starting.difference_update(self._key(p.item) for p in capped)
                    self._cond.notify_all()
            self._slots.release()
