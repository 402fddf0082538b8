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
from collections.abc import Callable
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
    """

    def __init__(
        self,
        run_batch: BatchFn,
        *,
        window_s: float,
        max_size: int,
        concurrent_batches: int = 1,
        company_expected: Callable[[], bool] | None = None,
        on_batch: Callable[[int, float], None] | None = None,
        clock: Clock = time.monotonic,
    ):
        self._run_batch = run_batch
        self._window = BatchWindow(window_s, max_size, clock)
        self._clock = clock
        self._company_expected = company_expected or (lambda: True)
        self._on_batch = on_batch
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
            self._cond.notify_all()
        return fut

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

    def _expect_company(self) -> bool:
        try:
            return bool(self._company_expected())
        except Exception:  # a failing probe must not stall batching; assume company
            log.debug("company_expected probe failed", exc_info=True)
            return True

    def _take_batch(self) -> list[_Pending[T]] | None:
        with self._cond:
            while True:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                if self._stopping and not self._pending:
                    return None
                size = len(self._pending)
                if self._stopping or self._window.ready(size):  # full, or the window has passed
                    break
                # The probe is a network round trip (LLEN): made without the lock, so that
                # submit() never waits on Redis.
                self._cond.release()
                try:
                    expected = self._expect_company()
                finally:
                    self._cond.acquire()
                size = len(self._pending)
                if self._stopping or self._window.ready(size, company_expected=expected and size < self._window.max_size):
                    break
                self._cond.wait(timeout=self._window.remaining())
            batch = self._pending[: self._window.max_size]
            del self._pending[: self._window.max_size]
            self._window.close()
            if self._pending:
                self._window.open(self._pending[0].arrived)
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
            self._slots.release()
