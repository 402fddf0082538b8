"""The ASGI app: ``uvicorn api.app:create_app --factory``."""

from __future__ import annotations

import asyncio
import contextlib
from contextlib import asynccontextmanager

import redis
from fastapi import FastAPI, Query, Request
from starlette.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from api import errors
from api.jobs import JobService
from api.result_backend import polling_backend_url
from api.waiter import JobWaiter
from api.schemas import ErrorResponse, JobCreate, JobCreated, JobView
from llmpipe.jobs import JobStore
from llmpipe.settings import Settings, get_settings


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    from llmpipe.celery_app import app as celery

    # The settings object passed in wins over the one celeryconfig read at import.
    celery.conf.update(broker_url=settings.redis_url, result_backend=polling_backend_url(settings.redis_url))
    r = redis.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=2, health_check_interval=30)
    service = JobService(celery, JobStore(r, settings.result_ttl_s), settings)

    waiter = JobWaiter(settings.redis_url)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        await waiter.close()
        r.close()

    app = FastAPI(
        title="llmpipe",
        version="0.1.0",
        description="LLM serving on a Celery pipeline: preprocess (CPU) -> batched inference -> postprocess (CPU).",
        lifespan=lifespan,
        responses={k: {"model": ErrorResponse, **v} for k, v in errors.ERROR_RESPONSES.items() if k in (422, 503)},
    )
    app.state.settings = settings
    app.state.jobs = service
    app.state.redis = r
    errors.install(app)

    job_errors = {k: {"model": ErrorResponse, **v} for k, v in errors.ERROR_RESPONSES.items() if k in (400, 413, 429)}

    @app.post("/v1/jobs", status_code=202, response_model=JobCreated, responses=job_errors, tags=["jobs"])
    def create_job(body: JobCreate, request: Request) -> JobCreated:
        """Enqueue a job; poll ``status_url`` for its result."""
        job_id = service.submit(body)
        return JobCreated(id=job_id, status="queued", status_url=str(request.url_for("get_job", job_id=job_id).path))

    @app.get("/v1/jobs/{job_id}", response_model=JobView, name="get_job", tags=["jobs"],
             responses={404: {"model": ErrorResponse, **errors.ERROR_RESPONSES[404]}})
    async def get_job(job_id: str, wait: float = Query(0.0, ge=0.0, le=60.0, description="Long-poll: wait up to this many seconds for the job to finish.")) -> JobView:
        """Status (queued, running, succeeded, failed, expired, cancelled) and, when done, the result."""
        if wait <= 0:
            return await run_in_threadpool(service.view, job_id)
        async with waiter.watch(job_id) as done:
            view = await run_in_threadpool(service.view, job_id)
            if view.status.terminal:
                return view
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), timeout=wait)
        return await run_in_threadpool(service.view, job_id)

    @app.get("/healthz", tags=["ops"])
    def healthz():
        r.ping()
        return JSONResponse({"status": "ok"})

    return app
