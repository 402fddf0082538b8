"""The polling job API: POST /v1/jobs, GET /v1/jobs/{id}[?wait=], DELETE /v1/jobs/{id}."""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import APIRouter, Query, Request
from starlette.concurrency import run_in_threadpool

from api.errors import ERROR_RESPONSES
from api.jobs import JobService
from api.schemas import ErrorResponse, JobCreate, JobCreated, JobView
from api.waiter import JobWaiter


def _errs(*codes: int) -> dict:
    return {c: {"model": ErrorResponse, **ERROR_RESPONSES[c]} for c in codes}


async def wait_view(service: JobService, waiter: JobWaiter, job_id: str, wait: float) -> JobView:
    """The job's view, once it is terminal or after ``wait`` seconds."""
    if wait <= 0:
        return await run_in_threadpool(service.view, job_id)
    async with waiter.watch(job_id) as done:
        view = await run_in_threadpool(service.view, job_id)
        if view.status.terminal:
            return view
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), timeout=wait)
    return await run_in_threadpool(service.view, job_id)


def router(service: JobService, waiter: JobWaiter) -> APIRouter:
    rt = APIRouter(prefix="/v1/jobs", tags=["jobs"])

    @rt.post("", status_code=202, response_model=JobCreated, responses=_errs(400, 429))
    def create_job(body: JobCreate, request: Request) -> JobCreated:
        """Enqueue a job; poll ``status_url`` (optionally with ``?wait=``) for its result."""
        job_id = service.submit(body)
        return JobCreated(id=job_id, status="queued", status_url=request.app.url_path_for("get_job", job_id=job_id))

    @rt.get("/{job_id}", response_model=JobView, name="get_job", responses=_errs(404))
    async def get_job(job_id: str, wait: float = Query(0.0, ge=0.0, le=60.0, description="Long-poll: wait up to this many seconds for the job to finish.")) -> JobView:
        """Status (queued, running, succeeded, failed, expired, cancelled); the text so far while
        it runs; the result when done."""
        return await wait_view(service, waiter, job_id, wait)

    @rt.delete("/{job_id}", response_model=JobView, responses=_errs(404))
    def cancel_job(job_id: str) -> JobView:
        """Cancel a job: queued work never runs, and running engine requests are aborted.
        A job that already finished is returned unchanged."""
        return service.cancel(job_id)

    return rt
