"""The polling job API: POST /v1/jobs, GET /v1/jobs/{id}[?wait=], POST /v1/jobs/{id}/cancel,
DELETE /v1/jobs/{id}. Error statuses are documented from api/openapi.py ROUTE_ERRORS."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import JSONResponse

from api.deps import Jobs, Waiter
from api.jobs.protocol import JobCreate, JobCreated, JobView
from api.jobs.service import wait_view
from api.request_keys import HEADER, REPLAYED_HEADER, key_of
from api.security import require_key

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], dependencies=[Depends(require_key)])


@router.post("", status_code=202, response_model=JobCreated)
def create_job(body: JobCreate, request: Request, jobs: Jobs,
               idempotency_key: str | None = Header(None, alias=HEADER, description=(
                   "Makes retries safe: a POST with a key that was used before (same API key, same body) "
                   "returns the job it made instead of a new one."))):
    """Enqueue a job; poll ``status_url`` (optionally with ``?wait=``) for its result."""
    key = key_of(request, idempotency_key, body)
    sub = jobs.submit(body, key)
    created = JobCreated(id=sub.job_id, status="queued", status_url=request.app.url_path_for("get_job", job_id=sub.job_id))
    if sub.replayed:
        created.status = jobs.view(sub.job_id, partial=False).status
        return JSONResponse(created.model_dump(mode="json"), status_code=202, headers={REPLAYED_HEADER: "true"})
    return created


@router.get("/{job_id}", response_model=JobView, name="get_job")
async def get_job(job_id: str, jobs: Jobs, waiter: Waiter,
                  wait: float = Query(0.0, ge=0.0, le=60.0,
                                      description="Long-poll: wait up to this many seconds for the job to finish.")) -> JobView:
    """Status (queued, running, succeeded, failed, expired, cancelled); the text so far while
    it runs; the result when done."""
    return await wait_view(jobs, waiter, job_id, wait)


@router.post("/{job_id}/cancel", response_model=JobView)
def cancel_job(job_id: str, jobs: Jobs) -> JobView:
    """Cancel a job: queued work never runs, and running engine requests are aborted. The
    job stays readable (``cancelled``). A job that already ended is returned unchanged: an
    ended job never changes."""
    return jobs.cancel(job_id)


@router.delete("/{job_id}", response_model=JobView)
def delete_job(job_id: str, jobs: Jobs) -> JobView:
    """Delete a job: cancelled first if it has not ended (as ``/cancel``), then forgotten:
    a later GET is 404. Answers the job as it was last."""
    return jobs.delete(job_id)
