"""Every API process runs one :class:`BatchRunner` (started in the app's lifespan): it feeds
the batches whose lease it holds, takes over those whose holder stopped renewing, and forgets
files and batches past their retention.

Each ``batch_scan_interval_s`` the runner reads the set of batches that still need work
(``validating``, ``in_progress``, ``finalizing``, ``cancelling``) and tries to take the
lease of each one it does not feed yet: a batch nobody holds (new, or its holder gave it
back) or whose holder's lease lapsed (that process died or stalled for ``batch_lease_ttl_s``)
is taken by the first live process that asks. A second task renews the leases it holds
every ttl / 3; a lease found lost (this process stalled and another one took the batch
over) cancels its feeder, which leaves the lines' jobs running for the new holder. On
shutdown the runner gives its leases back, so another process takes over at once.

The blocking Redis and file work runs in a small thread pool of its own, so a batch never
takes the threads that interactive requests are served from.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from api.batches.feeder import BatchFeeder, FeedEnv, LeaseLost
from llmpipe.batches.files import batch_dir
from llmpipe.batches.lease import lease_key

log = logging.getLogger("llmpipe.api.batches")

JANITOR_EVERY_S = 60.0
RETRY_AFTER_FAILURE_S = 10.0  # a feeder that failed (a full disk, a bug) is started again after this
IO_THREADS = 4


def executor() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="llmpipe-batch")


def io_on(pool: ThreadPoolExecutor):
    """``await io(fn, *args)``: ``fn`` on ``pool``, off the event loop."""
    async def io(fn, *args, **kw):
        return await asyncio.get_running_loop().run_in_executor(pool, partial(fn, *args, **kw))
    return io


class BatchRunner:
    def __init__(self, env: FeedEnv, *, scan_s: float, clock=time.monotonic):
        self.env = env
        self.scan_s = scan_s
        self._clock = clock
        self.feeders: dict[str, asyncio.Task] = {}
        self._tasks: list[asyncio.Task] = []
        self._janitor_at = 0.0
        self._retry_at: dict[str, float] = {}  # batch -> when to try feeding it again after a failure

    @property
    def leases(self):
        return self.env.leases

    def start(self) -> BatchRunner:
        self._tasks = [asyncio.create_task(self._every(self.scan_s, self.scan), name="llmpipe-batch-scan"),
                       asyncio.create_task(self._every(self.leases.ttl_s / 3, self.renew), name="llmpipe-batch-renew")]
        return self

    async def _every(self, seconds: float, step) -> None:
        while True:
            try:
                await step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away, a full disk: the next round tries again
                log.debug("batch runner: %s failed: %s: %s", step.__name__, type(exc).__name__, exc)
            await asyncio.sleep(seconds)

    async def scan(self) -> list[str]:
        """Take the lease of every batch that needs a feeder and has none live; returns those taken."""
        io = self.env.io
        taken = []
        for batch_id in await io(self.env.store.active):
            if batch_id in self.feeders or self._retry_at.get(batch_id, 0.0) > self._clock():
                continue
            got = await io(self.leases.acquire, batch_id)
            if got.ok:
                if got.other:
                    log.warning("batch=%s taken over from %s (its lease lapsed)", batch_id, got.other)
                self.feeders[batch_id] = asyncio.create_task(self._feed(batch_id), name=f"llmpipe-batch-{batch_id}")
                taken.append(batch_id)
        if self._clock() >= self._janitor_at:
            self._janitor_at = self._clock() + JANITOR_EVERY_S
            await io(self.janitor)
        return taken

    async def renew(self) -> list[str]:
        """Renew the leases held; a lost one's feeder stops (its lines' jobs go on). Returns those lost."""
        if not self.feeders:
            return []
        lost = await self.env.io(self.leases.renew, list(self.feeders))
        for batch_id in lost:
            task = self.feeders.pop(batch_id, None)
            if task is not None:
                log.warning("batch=%s: this process lost its lease (it stalled); another one feeds it", batch_id)
                task.cancel()
        return lost

    async def _feed(self, batch_id: str) -> None:
        io = self.env.io
        try:
            ended = await BatchFeeder(self.env, batch_id).run()
            if ended is None and await io(self.env.store.get, batch_id) is None:
                await io(self.env.store.drop_active, batch_id)
        except LeaseLost:
            log.warning("batch=%s: lease lost before a write; another process feeds it", batch_id)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("batch=%s: feeding failed; trying again in %.0f s", batch_id, RETRY_AFTER_FAILURE_S)
            self._retry_at[batch_id] = self._clock() + RETRY_AFTER_FAILURE_S
        finally:
            if self.feeders.get(batch_id) is asyncio.current_task():
                del self.feeders[batch_id]
                with contextlib.suppress(Exception):
                    await io(self.leases.release, batch_id)

    def janitor(self, now: float | None = None) -> None:
        """Forget files and batches past their retention (contents, records, leases)."""
        env = self.env
        env.files.sweep(now)
        for batch_id in env.store.due(now):
            with contextlib.suppress(ValueError):
                shutil.rmtree(batch_dir(env.files.root, batch_id), ignore_errors=True)
            env.store.forget(batch_id, extra_keys=(lease_key(batch_id),))

    async def close(self) -> None:
        """Stop feeding and give the leases back (the lines' jobs go on; another process resumes)."""
        for t in self._tasks:
            t.cancel()
        held = list(self.feeders)
        feeders = list(self.feeders.values())
        self.feeders.clear()
        for t in feeders:
            t.cancel()
        for t in (*self._tasks, *feeders):
            with contextlib.suppress(BaseException):
                await t
        for batch_id in held:
            with contextlib.suppress(Exception):
                await self.env.io(self.leases.release, batch_id)
