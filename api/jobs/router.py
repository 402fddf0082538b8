"""The polling job API: POST /v1/jobs, GET /v1/jobs/{id}[?wait=], POST /v1/jobs/{id}/cancel,
DELETE /v1/jobs/{id}."""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from api.jobs.protocol import JobCreate, JobCreated, JobView
from api.jobs.service import JobService
from api.request_keys import HEADER, request_key
from api.waiter import JobWaiter
from llmpipe.broker.redis_clients import UNAVAILABLE_ERRORS
from llmpipe.errors import UnavailableError
from llmpipe.jobs.store import JobRecord, parse_wake

_REDIS_DOWN = UNAVAILABLE_ERRORS
REPLAYED_HEADER = "Idempotent-Replayed"


def bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth[:7].lower() == "bearer " else None


async def wait_view(service: JobService, waiter: JobWaiter, job_id: str, wait: float, *,
                    partial: bool = True, through_outage: bool = False) -> JobView:
    """The job's view once it has ended, or after ``wait`` seconds (with the text so far).

    Each wake-up by a reconnect of the waiter reads the record again; one by the job's end
    carries the ended state. ``through_outage``: a Redis error while waiting is waited out until ``wait``
    ends, instead of answered with 503 (the caller's job is already running)."""
    if wait <= 0:
        return await run_in_threadpool(service.view, job_id, partial)
    loop = asyncio.get_running_loop()
    end = loop.time() + wait
    view: JobView | None = None
    rec: JobRecord | None = None
    async with waiter.watch(job_id) as woken:
        while True:
            # Woken by the job's terminal move: the record read before, with the move's
            # fields, is the record now (an ended record never changes), so no read.
            ended = rec.ended(parse_wake(woken.payload)) if rec is not None else None
            try:
                rec = ended if ended is not None else await run_in_threadpool(service.record, job_id)
                view = service.view_of(rec, False)
            except _REDIS_DOWN:
                if not through_outage:
                    raise
                view = rec = None
            if view is not None and view.status.terminal:
                return view
            left = end - loop.time()
            if left <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(woken.wait(), min(left, 1.0) if view is None else left)
            woken.clear()
    if view is None:
        raise UnavailableError("the queue (Redis) is unavailable; retry shortly")
    return await run_in_threadpool(service.view, job_id, partial) if partial else view


def router(service: JobService, waiter: JobWaiter) -> APIRouter:
    rt = APIRouter(prefix="/v1/jobs", tags=["jobs"])

    # Error statuses are documented from api/openapi.py ROUTE_ERRORS.
    @rt.post("", status_code=202, response_model=JobCreated)
    def create_job(body: JobCreate, request: Request,
                   idempotency_key: str | None = Header(None, alias=HEADER, description=(
                       "Makes retries safe: a POST with a key that was used before (same API key, same body) "
                       "returns the job it made instead of a new one."))):
        """Enqueue a job; poll ``status_url`` (optionally with ``?wait=``) for its result."""
        key = request_key(idempotency_key, api_key=bearer(request), path=request.url.path, body=body)
        sub = service.submit(body, key)
        created = JobCreated(id=sub.job_id, status="queued", status_url=request.app.url_path_for("get_job", job_id=sub.job_id))
        if sub.replayed:
            view = service.view(sub.job_id, partial=False)
            created.status = view.status
            return JSONResponse(created.model_dump(mode="json"), status_code=202, headers={REPLAYED_HEADER: "true"})
        return created

    @rt.get("/{job_id}", response_model=JobView, name="get_job")
    async def get_job(job_id: str, wait: float = Query(0.0, ge=0.0, le=60.0, description="Long-poll: wait up to this many seconds for the job to finish.")) -> JobView:
        """Status (queued, running, succeeded, failed, expired, cancelled); the text so far while
        it runs; the result when done."""
        return await wait_view(service, waiter, job_id, wait)

    @rt.post("/{job_id}/cancel", response_model=JobView)
    def cancel_job(job_id: str) -> JobView:
        """Cancel a job: queued work never runs, and running engine requests are aborted. The
        job stays readable (``cancelled``). A job that already ended is returned unchanged: an
        ended job never changes."""
        return service.cancel(job_id)

    @rt.delete("/{job_id}", response_model=JobView)
    def delete_job(job_id: str) -> JobView:
        """Delete a job: cancelled first if it has not ended (as ``/cancel``), then forgotten:
        a later GET is 404. Answers the job as it was last."""
        view = service.cancel(job_id)
        service.store.delete(job_id)
        return view

    return rt
