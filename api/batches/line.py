"""One batch line as an ordinary llmpipe job, from its request to its output line.

A line's body goes through what the synchronous endpoint does with a request body: the
same request model under the app's limits, the same checks and job inputs
(api/openai/service.py ``prepare``), ``JobService.submit_inputs`` in the batch lane, and
the same answer from the finished job (``raise_for``, ``Shape.build``). So its output line
carries the body that the endpoint would have answered, and a line that fails carries the
endpoint's status and error body (api/errors.py ``answer_of``).

The job's id is the batch's, the line's and the run's (``<batch>-l<line>-a<run>``), and
an ``Idempotency-Key`` of the same name makes it once: a feeder that takes the batch over
submits the line again and gets the job that runs (or ran) already, never a second one.
A 429 from admission halves the batch's window (:class:`~llmpipe.batches.aimd.Aimd`) and
the line waits ``Retry-After`` before it is sent again; an outage is waited out. A job that
expired in the queues (its own deadline, not the batch's window) or met an outage runs again,
up to ``batch_line_attempts`` runs.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum

from pydantic import ValidationError

from api.aio import within
from api.detok import Detokenizers
from api.errors import PayloadTooLargeError, answer_of
from api.jobs.protocol import JobView
from api.jobs.service import JobService, Submitted, wait_view
from api.openai.service import REQUESTS, Prepared, prepare, raise_for
from api.request_keys import IdempotencyKeyInUse, RequestKey
from api.validation import Limits, limits_scope
from api.waiter import JobWaiter
from llmpipe.batches.aimd import Aimd
from llmpipe.batches.input import InputLine
from llmpipe.batches.output import Line
from llmpipe.batches.records import BatchStore
from llmpipe.broker.redis_clients import UNAVAILABLE_ERRORS
from llmpipe.errors import BadRequestError, LlmpipeError, NotFoundError, OverloadedError, UnavailableError
from llmpipe.messages import ErrorReason, JobStatus
from llmpipe.observability import metrics
from llmpipe.settings import Settings

log = logging.getLogger("llmpipe.api.batches")

WAIT_S = 30.0  # one long wait on a line's job; a wake ends it sooner
_RETRYABLE = {ErrorReason.UNAVAILABLE, ErrorReason.OVERLOADED, ErrorReason.EXPIRED}


class Stop(Enum):
    """Why a batch stops before its lines are done: the code and message of each line that
    did not run (OpenAI's)."""

    CANCELLED = ("batch_cancelled", "This request was not executed because the batch was cancelled.")
    EXPIRED = ("batch_expired", "This request could not be executed before the completion window expired.")

    @property
    def code(self) -> str:
        return self.value[0]

    @property
    def message(self) -> str:
        return self.value[1]


@dataclass
class LineEnv:
    """What the lines of one batch share."""

    batch_id: str
    endpoint: str
    jobs: JobService
    waiter: JobWaiter
    settings: Settings
    detok: Detokenizers
    limits: Limits
    store: BatchStore
    aimd: Aimd
    io: Callable[..., Awaitable]  # runs a blocking call off the event loop
    stop: asyncio.Event
    stopped: Stop | None = None

    async def pause(self, seconds: float) -> None:
        """Sleep, or less once the batch stops."""
        await within(self.stop.wait(), max(0.05, seconds))


def line_job_id(batch_id: str, index: int, run: int) -> str:
    return f"{batch_id}-l{index}-a{run}"


def record_id(job_id: str) -> str:
    return f"batch_req_{hashlib.sha256(job_id.encode()).hexdigest()[:32]}"


def unrun_line(line: InputLine, stop: Stop, job_id: str) -> Line:
    """A line the batch stopped before it ran."""
    return Line(line.custom_id, {"id": record_id(job_id), "custom_id": line.custom_id, "response": None,
                                 "error": {"code": stop.code, "message": stop.message}}, ok=False)


def cancel_job(jobs: JobService, job_id: str) -> None:
    """Cancel a line's job (its engine requests are aborted); one already gone is left."""
    try:
        jobs.cancel(job_id)
    except NotFoundError:
        pass


class LineRun:
    def __init__(self, env: LineEnv, line: InputLine, request: dict, run: int = 0):
        self.env = env
        self.line = line
        self.request = request
        self.run = run
        self.submitted = False
        self.model = ""  # the served model's name once the body is checked (metrics)

    @property
    def job_id(self) -> str:
        return line_job_id(self.env.batch_id, self.line.index, self.run)

    async def __call__(self) -> Line:
        try:
            prep = self._prepare()
        except (LlmpipeError, ValidationError) as exc:
            return self._failed(exc)
        try:
            return await self._run(prep)
        except asyncio.CancelledError:
            raise
        except (LlmpipeError, ValidationError) as exc:
            return self._failed(exc)
        except Exception as exc:  # a bug: the line fails as the endpoint would answer it (500), the batch goes on
            log.exception("batch=%s line=%d failed", self.env.batch_id, self.line.index)
            return self._failed(exc)

    def _prepare(self) -> Prepared:
        env = self.env
        body = self.request["body"]
        size = len(json.dumps(body, separators=(",", ":")).encode())
        if size > env.settings.max_body_bytes:
            raise PayloadTooLargeError(f"request body is over {env.settings.max_body_bytes} bytes (max_body_bytes)")
        with limits_scope(env.limits):
            req = REQUESTS[env.endpoint].model_validate(body)
        if req.stream:
            raise BadRequestError("a batch line cannot stream: leave out `stream`", param="stream")
        prep = prepare(env.endpoint, req, env.jobs, env.settings, env.detok)
        self.model = env.jobs.models.get(req.model).name
        return prep

    async def _run(self, prep: Prepared) -> Line:
        env = self.env
        while True:
            if env.stopped is not None:
                return unrun_line(self.line, env.stopped, self.job_id)
            sub = await self._submit(prep)
            if sub is None:
                return unrun_line(self.line, env.stopped or Stop.CANCELLED, self.job_id)
            metrics.BATCH_LINES_IN_FLIGHT.labels(self.model).inc()
            try:
                if env.stopped is not None:  # it stopped while this line was being submitted
                    await env.io(cancel_job, env.jobs, sub.job_id)
                view = await self._wait(sub.job_id)
            finally:
                metrics.BATCH_LINES_IN_FLIGHT.labels(self.model).dec()
            if view.status == JobStatus.SUCCEEDED:
                body = prep.shape.build(sub.job_id, view).model_dump(mode="json", by_alias=True)
                return self._answered(200, body)
            if env.stopped is not None and view.status == JobStatus.CANCELLED:
                return unrun_line(self.line, env.stopped, self.job_id)
            if self._retry(view):
                self.run += 1
                await env.io(env.store.set_attempt, env.batch_id, self.line.index, self.run)
                log.info("batch=%s line=%d job %s ended %s; running it again (run %d)", env.batch_id,
                         self.line.index, sub.job_id, view.status.value, self.run + 1)
                continue
            try:
                raise_for(view)
            except LlmpipeError as exc:
                return self._failed(exc)

    def _retry(self, view: JobView) -> bool:
        if self.env.stopped is not None or self.run + 1 >= self.env.settings.batch_line_attempts:
            return False
        reason = view.error.type if view.error else None
        return view.status == JobStatus.EXPIRED or reason in _RETRYABLE

    async def _submit(self, prep: Prepared) -> Submitted | None:
        """The line's job, submitted (or found: it was made before); None once the batch stops."""
        env, req = self.env, prep.shape.req
        key = RequestKey(f"llmpipe:batch-line:{self.job_id}", self.job_id, self.job_id)
        while env.stopped is None:
            try:
                sub = await env.io(
                    env.jobs.submit_inputs, prep.inputs, prep.params, timeout=req.timeout or env.settings.max_timeout_s,
                    kind="batch", key=key, choices=req.n, priority=max(req.priority, env.settings.lane_batch_priority),
                    model=req.model, job_id=self.job_id, meta={"batch": env.batch_id, "line": self.line.index})
            except OverloadedError as exc:
                env.aimd.overloaded()
                delay = exc.retry_after_s
            except (UnavailableError, IdempotencyKeyInUse, *UNAVAILABLE_ERRORS) as exc:
                delay = getattr(exc, "retry_after_s", 1.0)
            else:
                self.submitted = True
                if not sub.replayed:
                    env.aimd.admitted()
                return sub
            await env.pause(min(max(delay, 0.5), 10.0))
        return None

    async def _wait(self, job_id: str) -> JobView:
        env = self.env
        while True:
            try:
                view = await wait_view(env.jobs, env.waiter, job_id, WAIT_S, partial=False, through_outage=True)
            except (UnavailableError, *UNAVAILABLE_ERRORS):
                await asyncio.sleep(1.0)
                continue
            if view.status.terminal:
                return view

    def _answered(self, status: int, body: dict) -> Line:
        rec = {"id": record_id(self.job_id), "custom_id": self.line.custom_id,
               "response": {"status_code": status, "request_id": self.job_id, "body": body}, "error": None}
        if status != 200:
            err = body.get("error") or {}
            rec["error"] = {"code": err.get("type"), "message": err.get("message")}
        return Line(self.line.custom_id, rec, ok=status == 200, model=self.model)

    def _failed(self, exc: Exception) -> Line:
        status, body = answer_of(exc, self.env.endpoint)
        return self._answered(status, body)
