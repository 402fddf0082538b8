"""The ASGI app: ``uvicorn api.app:serve_app --factory`` (``llmpipe api`` runs it)."""

from __future__ import annotations

import asyncio
import contextlib
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

import celeryconfig
from api import errors
from api.detok import Detokenizers
from api.errors import ErrorResponse
from api.jobs.protocol import UNION_TAGS
from api.jobs.router import router as jobs_router
from api.jobs.service import JobService
from api.openai.router import router as openai_router
from api.openapi import MethodsAllowed, document_errors
from api.ops.admin import router as admin_router
from api.ops.health import require_live_stages
from api.ops.metrics import build_registries
from api.ops.metrics import router as metrics_router
from api.security import BodyLimit, require_key
from api.validation import Limits, bind, prepared_model_path
from api.vllm.router import router as vllm_router
from api.waiter import JobWaiter
from llmpipe.broker.polling_backend import polling_backend_url
from llmpipe.broker.queue_depth import depth_reader
from llmpipe.broker.redis_clients import fail_fast_retry, from_settings
from llmpipe.jobs.admission import Admission
from llmpipe.jobs.store import JobStore
from llmpipe.observability.heap import freeze_heap
from llmpipe.settings import Settings, get_settings


def _model_path(settings: Settings, source: str) -> str:
    from llmpipe.models.registry import resolve_model

    return resolve_model(source, settings.models_dir)


def serve_app() -> FastAPI:
    """The app of a server process: ``create_app`` with the settings of the environment,
    then start-up's heap frozen (llmpipe/observability/heap.py), since an API process keeps it to its end.
    Tests build apps with ``create_app``, which freezes nothing in their process."""
    app = create_app()
    freeze_heap()
    return app


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    from llmpipe.celery_app import app as celery

    # The settings object passed in wins over the ones celeryconfig read at import; the API
    # reads job results through its own backend (llmpipe/broker/polling_backend.py).
    celery.conf.update({**celeryconfig.build(settings), "result_backend": polling_backend_url(settings.redis_url)})
    r = from_settings(settings, socket_timeout=5, socket_connect_timeout=2, health_check_interval=30, retry=fail_fast_retry())
    # RabbitMQ: a sample serves 50 ms. Admission counts every job published since the
    # sample as queued, so an older one would refuse a burst that the workers drain as it comes.
    depths = depth_reader(settings.effective_broker_url, r, max_age_s=0.05)
    # On Redis the admission script reads the queues itself (atomically); RabbitMQ's are read here.
    admission = Admission(r, max_queue_depth=settings.max_queue_depth, max_queued_tokens=settings.max_queued_prompt_tokens,
                          depths=depths if settings.broker_is_amqp else None, batch_share=settings.lane_batch_share)
    # Each served model's tokenizer.json, for partial and streamed text (llmpipe/models/served.py).
    detok = Detokenizers(settings.served, lambda source: _model_path(settings, source))
    service = JobService(celery, JobStore(r, settings.result_ttl_s), settings, admission, detok)
    waiter = JobWaiter(settings.redis_url, master_name=settings.redis_sentinel_master)

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
        depths.close()
        r.close()

    app = FastAPI(
        title="llmpipe",
        version="0.1.0",
        description=(
            "LLM serving on a Celery pipeline: preprocess (CPU) -> batched inference -> postprocess (CPU). "
            "Errors always come as `{\"error\": {\"type\", \"message\", \"param\", \"code\"}}`; each route lists "
            "the statuses it can answer. The request schemas carry this server's limits (max_tokens_limit, max_n, "
            "max_prompts_per_job, max_prompt_chars, max_logprobs); a request over one is 400 `limit_exceeded`."
        ),
        lifespan=lifespan,
        responses={k: {"model": ErrorResponse, **v} for k, v in errors.ERROR_RESPONSES.items() if k in (401, 403, 413, 422, 503)},
    )
    app.state.settings = settings
    app.state.jobs = service
    app.state.waiter = waiter
    app.state.redis = r
    errors.install(app, union_tags=UNION_TAGS)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    # The limits of these settings validate every request and appear in /openapi.json.
    bind(app, Limits.from_settings(settings, model_paths=[lambda src=m.source: prepared_model_path(settings, src)
                                                          for m in settings.served.models]),
         post_process=lambda spec: document_errors(app, spec))
    app.add_middleware(MethodsAllowed, routes_of=lambda: app.routes)

    auth = [Depends(require_key(settings.api_key_set))]
    app.include_router(jobs_router(service, waiter), dependencies=auth)
    app.include_router(openai_router(service, waiter, settings, detok), dependencies=auth)
    app.include_router(metrics_router(build_registries(depths, r, settings.served)), dependencies=auth)
    app.include_router(admin_router(r, settings.deadletter_ttl_s, settings.deadletter_max_entries), dependencies=auth)
    # vLLM's probes (/health, /ping, /version) need no key, as /healthz; /tokenize and /detokenize do.
    app.include_router(vllm_router(celery, r, waiter, settings, detok, auth))

    @app.get("/healthz", tags=["ops"], responses={503: {"model": ErrorResponse, **errors.ERROR_RESPONSES[503]}})
    def healthz():
        """Ready to serve: Redis answers and every stage has a live worker; else 503 naming
        what is missing (``stages``; with several models, a model's
        inference queue, such as ``inference.tiny``). Needs no API key. A stage whose last worker died is
        seen within 15 s (the readiness keys' TTL)."""
        r.ping()
        return JSONResponse({"status": "ok", "live_workers": require_live_stages(r, settings.served.readiness_stages())})

    return app
