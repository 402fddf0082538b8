"""Feeding one batch, in the API process that holds its lease (api/batches/runner.py).

``validating``: the input file is scanned (llmpipe/batches/input.py); an error fails the
batch with OpenAI's ``errors`` list and no line runs. ``in_progress``: the lines missing
from the output and error files are fed in order, at most the window's worth in flight
(:class:`~llmpipe.batches.aimd.Aimd`, up to ``batch_max_in_flight``), each as one job
(api/batches/line.py); finished lines are written a group at a time (after checking the
lease is still held) and then counted in the record. ``finalizing``: the files are sealed
(each ``custom_id`` once, llmpipe/batches/output.py) and published as ``batch_output`` files,
and the batch ends ``completed``.

A cancel (the record is ``cancelling``) or the end of the completion window stops the
feeding: the lines in flight are cancelled (their engine requests aborted), a line whose
job finished first keeps its answer, and every other line goes to the error file with
``batch_cancelled`` or ``batch_expired``; the batch ends ``cancelled`` or ``expired``.

All the state a feeder needs is in Redis and the files, so a feeder that takes the batch
over (its holder died) starts the same way: scan, open the files (a torn last line cut,
the written ``custom_id`` rebuilt), feed what is missing. Lines the dead process had in
flight are submitted again under their job ids, which find the jobs that run already.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import IO

from api.batches.line import LineEnv, LineRun, Stop, cancel_job, line_job_id, unrun_line
from api.detok import Detokenizers
from api.jobs.service import JobService
from api.validation import Limits
from api.waiter import JobWaiter
from llmpipe.batches import input as batch_input
from llmpipe.batches.aimd import Aimd
from llmpipe.batches.files import PURPOSE_OUTPUT, FileStore, batch_input_path, output_file_ids
from llmpipe.batches.lease import BatchLeases
from llmpipe.batches.output import BatchOutput, Counts, Line
from llmpipe.batches.records import BatchRecord, BatchStatus, BatchStore
from llmpipe.errors import ModelNotFoundError
from llmpipe.observability import metrics
from llmpipe.settings import Settings

log = logging.getLogger("llmpipe.api.batches")

TICK_S = 0.5  # how often a feeder reads its record (a cancel, the window) while lines run


class LeaseLost(Exception):
    """Another process holds the batch now: this one stops without writing."""


@dataclass
class FeedEnv:
    """The app's collaborators a feeder uses (api/app.py makes one per process)."""

    jobs: JobService
    waiter: JobWaiter
    settings: Settings
    detok: Detokenizers
    limits: Limits
    store: BatchStore
    files: FileStore
    leases: BatchLeases
    io: Callable[..., Awaitable]
    clock: Callable[[], float] = time.time


_END = {None: BatchStatus.COMPLETED, Stop.CANCELLED: BatchStatus.CANCELLED, Stop.EXPIRED: BatchStatus.EXPIRED}
_FROM = {BatchStatus.COMPLETED: (BatchStatus.FINALIZING,), BatchStatus.CANCELLED: (BatchStatus.CANCELLING,),
         BatchStatus.EXPIRED: (BatchStatus.IN_PROGRESS,)}


class BatchFeeder:
    def __init__(self, env: FeedEnv, batch_id: str, *, tick_s: float = TICK_S):
        self.env = env
        self.batch_id = batch_id
        self.tick_s = tick_s
        s = env.settings
        self.aimd = Aimd(s.batch_max_in_flight)
        self._attempts: dict[int, int] = {}
        self.paths = (batch_input_path(env.files.root, batch_id), *(env.files.path(f) for f in output_file_ids(batch_id)))

    async def io(self, fn, *args, **kw):
        return await self.env.io(partial(fn, *args, **kw))

    async def run(self) -> BatchStatus | None:
        """Feed the batch to its end; returns the status it ended in (None: nothing to do)."""
        env = self.env
        rec = await self.io(env.store.get, self.batch_id)
        if rec is None or rec.status.terminal:
            return None
        s = env.settings
        scan = await self.io(batch_input.scan, self.paths[0], endpoint=rec.endpoint, max_lines=s.batch_max_lines,
                             max_bytes=s.batch_max_file_bytes)
        if rec.status is BatchStatus.VALIDATING:
            rec = await self._validated(rec, scan)
            if rec is None:
                return BatchStatus.FAILED
        out = await self.io(BatchOutput.open, self.paths[1], self.paths[2])
        try:
            await self.io(env.store.progress, self.batch_id, total=len(scan.lines), **out.counts.fields())
            stop = None
            for _ in range(3):  # a seal that dropped an unreadable line: feed it again
                stop = await self._feed(rec, scan, out)
                if stop is None and not await self._finalizing():
                    stop = Stop.CANCELLED
                counts = await self.io(out.seal)
                if stop is not None or len(out.written) >= len(scan.lines):
                    break
            return await self._publish(stop, counts)
        finally:
            out.close()

    async def _validated(self, rec: BatchRecord, scan: batch_input.Scan) -> BatchRecord | None:
        """The batch once its input passed (None: it failed, and no line runs)."""
        env = self.env
        if scan.errors:
            await self.io(env.store.move, self.batch_id, BatchStatus.FAILED, (BatchStatus.VALIDATING,),
                          {"errors": scan.errors})
            log.info("batch=%s failed validation: %d error(s)", self.batch_id, len(scan.errors))
            return None
        model = self._model(scan)
        fields = {"total": len(scan.lines), **({"model": model} if model else {})}
        await self.io(env.store.move, self.batch_id, BatchStatus.IN_PROGRESS, (BatchStatus.VALIDATING,), fields)
        return await self.io(env.store.get, self.batch_id)

    def _model(self, scan: batch_input.Scan) -> str | None:
        """The batch's model, when every line names the same one (or none: the default)."""
        if len(scan.models) != 1:
            return None
        name = next(iter(scan.models)) or None
        try:
            return self.env.jobs.models.get(name).id
        except ModelNotFoundError:  # each line fails with model_not_found
            return name

    def _stop_of(self, rec: BatchRecord | None) -> Stop | None:
        if rec is None or rec.status in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
            return Stop.CANCELLED
        if rec.status is BatchStatus.IN_PROGRESS and self.env.clock() >= rec.expires_at:
            return Stop.EXPIRED
        return None

    async def _feed(self, rec: BatchRecord, scan: batch_input.Scan, out: BatchOutput) -> Stop | None:
        """Run the lines not written yet, to the last or until the batch stops (its reason)."""
        env = self.env
        self._attempts = await self.io(env.store.attempts, self.batch_id)
        todo = deque(ln for ln in scan.lines if ln.custom_id not in out.written)
        lines = LineEnv(self.batch_id, rec.endpoint, env.jobs, env.waiter, env.settings, env.detok, env.limits,
                        env.store, self.aimd, env.io, asyncio.Event())
        runs: dict[asyncio.Task, LineRun] = {}
        f = await self.io(open, self.paths[0], "rb")
        try:
            stop = await self._loop(lines, todo, runs, out, f)
            if stop is not None:
                await self._stop(lines, stop, runs, todo, out)
            return stop
        finally:
            for t in runs:
                t.cancel()
            if runs:  # gone before the feeder is: none is left waiting on a job
                await asyncio.gather(*runs, return_exceptions=True)
            f.close()

    async def _loop(self, lines: LineEnv, todo: deque, runs: dict, out: BatchOutput, f: IO[bytes]) -> Stop | None:
        env = self.env
        check_at = 0.0
        while True:
            if time.monotonic() >= check_at:
                stop = self._stop_of(await self.io(env.store.get, self.batch_id))
                if stop is not None:
                    return stop
                check_at = time.monotonic() + self.tick_s
            while todo and len(runs) < self.aimd.window:
                ln = todo.popleft()
                run = LineRun(lines, ln, await self.io(batch_input.read_line, f, ln), self._run_of(ln))
                runs[asyncio.create_task(run(), name=f"batch-line-{ln.index}")] = run
            if not runs:
                return None
            done, _ = await asyncio.wait(runs, timeout=self.tick_s, return_when=asyncio.FIRST_COMPLETED)
            await self._commit([t.result() for t in done], out)
            for t in done:
                runs.pop(t)

    def _run_of(self, ln: batch_input.InputLine) -> int:
        """The line's run now (0, or the one it was retried to)."""
        return self._attempts.get(ln.index, 0)

    async def _stop(self, lines: LineEnv, stop: Stop, runs: dict, todo: deque, out: BatchOutput) -> None:
        """Cancel what runs; every line that did not finish goes to the error file with ``stop``."""
        lines.stopped = stop
        lines.stop.set()
        for run in list(runs.values()):
            if run.submitted:
                await self.io(cancel_job, self.env.jobs, run.job_id)
        finished = await asyncio.gather(*runs)
        runs.clear()
        left = [unrun_line(ln, stop, line_job_id(self.batch_id, ln.index, self._run_of(ln))) for ln in todo]
        # A process that fed the batch before this one had lines in flight that this one had not
        # reached yet: the first unwritten ones. Their jobs are cancelled too (most have none).
        for ln in list(todo)[:self.env.settings.batch_max_in_flight]:
            await self.io(cancel_job, self.env.jobs, line_job_id(self.batch_id, ln.index, self._run_of(ln)))
        todo.clear()
        await self._commit([*finished, *left], out)
        log.info("batch=%s stopped (%s): %d line(s) in flight cancelled, %d not run", self.batch_id, stop.code,
                 len(finished), len(left))

    async def _commit(self, lines: list[Line], out: BatchOutput) -> None:
        """Write finished lines, then count them; only while this process holds the batch."""
        if not lines:
            return
        env = self.env
        if not await self.io(env.leases.held, self.batch_id):
            raise LeaseLost(self.batch_id)
        written = await self.io(out.write, lines)
        await self.io(env.store.progress, self.batch_id, **out.counts.fields())
        for ln in written:
            metrics.BATCH_LINES.labels(ln.model, "completed" if ln.ok else "failed").inc()

    async def _finalizing(self) -> bool:
        """in_progress -> finalizing; False when the batch started cancelling meanwhile."""
        env = self.env
        if await self.io(env.store.move, self.batch_id, BatchStatus.FINALIZING, (BatchStatus.IN_PROGRESS,)):
            return True
        rec = await self.io(env.store.get, self.batch_id)
        return rec is not None and rec.status is BatchStatus.FINALIZING

    async def _publish(self, stop: Stop | None, counts: Counts) -> BatchStatus | None:
        """The sealed files as ``batch_output`` files, and the batch's end."""
        env = self.env
        out_id, err_id = output_file_ids(self.batch_id)
        fields: dict = dict(counts.fields())
        for fid, n, name in ((out_id, counts.completed, "output"), (err_id, counts.failed, "error")):
            if n:
                size = (await self.io(env.files.path(fid).stat)).st_size
                await self.io(env.files.record, fid, size, f"{self.batch_id}_{name}.jsonl", PURPOSE_OUTPUT)
                fields[f"{name}_file_id"] = fid
        end = _END[stop]
        if not await self.io(env.store.move, self.batch_id, end, _FROM[end], fields):
            # expired while the client cancelled: the cancel wins, with the same files
            end = BatchStatus.CANCELLED
            if not await self.io(env.store.move, self.batch_id, end, _FROM[end], fields):
                return None
        await self.io(env.store.r.delete, env.store.attempts_key(self.batch_id))
        log.info("batch=%s %s: %d completed, %d failed", self.batch_id, end.value, counts.completed, counts.failed)
        return end
