"""The ASGI app: ``uvicorn api.app:create_app --factory``."""

from __future__ import annotations

import asyncio
import contextlib
from contextlib import asynccontextmanager

import redis
from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from api import errors
from api.detok import Detokenizer
from api.jobs import JobService
from api.metrics_route import build_registries
from api.metrics_route import router as metrics_router
from api.result_backend import polling_backend_url
from api.routes_admin import router as admin_router
from api.routes_jobs import router as jobs_router
from api.routes_openai import router as openai_router
from api.routes_vllm import router as vllm_router
from api.schemas import ErrorResponse
from api.security import BodyLimit, require_key
from api.waiter import JobWaiter
from llmpipe.admission import Admission
from llmpipe.jobs import JobStore
from llmpipe.settings import Settings, get_settings


def _model_path(settings: Settings) -> str:
    from llmpipe.models.registry import resolve_model

    return resolve_model(settings.model, settings.models_dir)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    from llmpipe.celery_app import app as celery

    # The settings object passed in wins over the one celeryconfig read at import.
    celery.conf.update(broker_url=settings.redis_url, result_backend=polling_backend_url(settings.redis_url))
    r = redis.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=2, health_check_interval=30)
    admission = Admission(r, max_queue_depth=settings.max_queue_depth, max_queued_tokens=settings.max_queued_prompt_tokens)
    detok = Detokenizer(lambda: _model_path(settings))
    service = JobService(celery, JobStore(r, settings.result_ttl_s), settings, admission, detok)
    waiter = JobWaiter(settings.redis_url)

    async def sample_drain() -> None:
        # The drain rate behind Retry-After: one sample of the drained-jobs counter a second.
        while True:
            with contextlib.suppress(Exception):
                await run_in_threadpool(admission.sample_drain)
            await asyncio.sleep(1.0)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        task = asyncio.create_task(sample_drain())
        yield
        task.cancel()
        await waiter.close()
        r.close()

    app = FastAPI(
        title="llmpipe",
        version="0.1.0",
        description=(
            "LLM serving on a Celery pipeline: preprocess (CPU) -> batched inference -> postprocess (CPU). "
            "Errors always come as `{\"error\": {\"type\", \"message\", \"param\"}}`."
        ),
        lifespan=lifespan,
        responses={k: {"model": ErrorResponse, **v} for k, v in errors.ERROR_RESPONSES.items() if k in (401, 403, 413, 422, 503)},
    )
    app.state.settings = settings
    app.state.jobs = service
    app.state.waiter = waiter
    app.state.redis = r
    errors.install(app)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)

    auth = [Depends(require_key(settings.api_key_set))]
    app.include_router(jobs_router(service, waiter), dependencies=auth)
    app.include_router(openai_router(service, waiter, settings, detok), dependencies=auth)
    app.include_router(metrics_router(build_registries(r)), dependencies=auth)
    app.include_router(admin_router(r, settings.deadletter_ttl_s, settings.deadletter_max_entries), dependencies=auth)
    # vLLM's probes (/health, /ping, /version) need no key, as /healthz; /tokenize and /detokenize do.
    app.include_router(vllm_router(celery, r, waiter, settings, detok, auth))

    @app.get("/healthz", tags=["ops"], responses={503: {"model": ErrorResponse, **errors.ERROR_RESPONSES[503]}})
    def healthz():
        """Liveness and Redis reachability; needs no API key."""
        r.ping()
        return JSONResponse({"status": "ok"})

    return app
