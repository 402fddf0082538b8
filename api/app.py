"""The ASGI app: ``uvicorn api.app:serve_app --factory`` (``llmpipe api`` runs it).

``create_app`` makes the app's collaborators once and keeps them on ``app.state``, where the
routers' dependencies read them (api/deps.py); each surface's router is module-level."""

from __future__ import annotations

import asyncio
import contextlib
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

import celeryconfig
from api import errors
from api.batches.feeder import FeedEnv
from api.batches.metrics import BatchesCollector
from api.batches.router import router as batches_router
from api.batches.runner import BatchRunner, executor, io_on
from api.batches.service import BatchAPI
from api.detok import Detokenizers
from api.jobs.protocol import UNION_TAGS
from api.jobs.router import router as jobs_router
from api.jobs.service import JobService
from api.openai.router import router as openai_router
from api.openapi import MethodsAllowed, document_errors
from api.ops.metrics import build_registries
from api.ops.router import router as ops_router
from api.security import BodyLimit
from api.token_streams import TokenStreams
from api.validation import Limits, bind, prepared_model_path
from api.vllm.router import router as vllm_router
from api.waiter import JobWaiter
from llmpipe.batches.files import FileStore
from llmpipe.batches.lease import BatchLeases
from llmpipe.batches.records import BatchStore
from llmpipe.broker.polling_backend import polling_backend_url
from llmpipe.broker.queue_depth import depth_reader
from llmpipe.broker.redis_clients import afrom_settings, fail_fast_retry, from_settings
from llmpipe.celery_app import app as celery
from llmpipe.jobs.admission import Admission
from llmpipe.jobs.deadletter import DeadLetters
from llmpipe.jobs.store import JobStore
from llmpipe.models.registry import resolve_model
from llmpipe.observability.heap import freeze_heap
from llmpipe.settings import Settings, get_settings

# Every surface, in the order of the OpenAPI document. Each router names its own API-key
# dependency; vLLM's probes (/health, /ping, /version) and /healthz need none.
ROUTERS = (jobs_router, openai_router, batches_router, ops_router, vllm_router)

UPLOAD_FORM_BYTES = 1 << 20  # an upload's form fields and part headers, around its file

_DESCRIPTION = (
    "LLM serving on a Celery pipeline: preprocess (CPU) -> batched inference -> postprocess (CPU). "
    "Errors always come as `{\"error\": {\"type\", \"message\", \"param\", \"code\"}}`; each route lists "
    "the statuses it can answer. The request schemas carry this server's limits (max_tokens_limit, max_n, "
    "max_prompts_per_job, max_prompt_chars, max_logprobs); a request over one is 400 `limit_exceeded`."
)


def _model_path(settings: Settings, source: str) -> str:
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

    # The settings object passed in wins over the ones celeryconfig read at import; the API
    # reads job results through its own backend (llmpipe/broker/polling_backend.py).
    celery.conf.update({**celeryconfig.build(settings), "result_backend": polling_backend_url(settings.redis_url)})
    app = FastAPI(title="llmpipe", version="0.1.0", description=_DESCRIPTION, lifespan=_lifespan,
                  responses=errors.responses(401, 403, 413, 422, 503))
    _add_state(app, settings)
    errors.install(app, union_tags=UNION_TAGS)
    # An upload's own limit: its file is checked against batch_max_file_bytes as it streams
    # in (api/batches/upload.py); the form around it is small.
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes,
                       paths={"/v1/files": (settings.batch_max_file_bytes + UPLOAD_FORM_BYTES, "batch_max_file_bytes")})
    # The limits of these settings validate every request and appear in /openapi.json.
    bind(app, app.state.limits, post_process=lambda spec: document_errors(app, spec))
    app.add_middleware(MethodsAllowed, routes_of=lambda: app.routes)
    for router in ROUTERS:
        app.include_router(router)
    return app


def _add_state(app: FastAPI, settings: Settings) -> None:
    """The app's collaborators, each made once, on ``app.state`` (api/deps.py reads them)."""
    st = app.state
    st.settings, st.served, st.api_keys, st.celery = settings, settings.served, settings.api_key_set, celery
    r = st.redis = from_settings(settings, socket_timeout=5, socket_connect_timeout=2, health_check_interval=30,
                                 retry=fail_fast_retry())
    # SSE streams get their job's tokens from one reader (api/token_streams.py).
    st.streams = TokenStreams(settings.redis_url, afrom_settings(settings, socket_connect_timeout=2),
                              master_name=settings.redis_sentinel_master)
    # RabbitMQ: a sample serves 50 ms. Admission counts every job published since the
    # sample as queued, so an older one would refuse a burst that the workers drain as it comes.
    depths = st.depths = depth_reader(settings.effective_broker_url, r, max_age_s=0.05)
    # On Redis the admission script reads the queues itself (atomically); RabbitMQ's are read here.
    st.admission = Admission(r, max_queue_depth=settings.max_queue_depth, max_queued_tokens=settings.max_queued_prompt_tokens,
                             depths=depths if settings.broker_is_amqp else None, batch_share=settings.lane_batch_share)
    # Each served model's tokenizer.json, for partial and streamed text (llmpipe/models/served.py).
    st.detok = Detokenizers(st.served, lambda source: _model_path(settings, source))
    st.jobs = JobService(celery, JobStore(r, settings.result_ttl_s), settings, st.admission, st.detok)
    st.waiter = JobWaiter(settings.redis_url, master_name=settings.redis_sentinel_master)
    st.deadletters = DeadLetters(r, ttl_s=settings.deadletter_ttl_s, max_entries=settings.deadletter_max_entries)
    st.limits = Limits.from_settings(settings, model_paths=[lambda src=m.source: prepared_model_path(settings, src)
                                                            for m in settings.served.models])
    _add_batches(st, settings)
    st.registries = build_registries(depths, r, st.served, extra=(BatchesCollector(st.batches),))


def _add_batches(st, settings: Settings) -> None:
    """The Batch API's stores and service, and what this process's batch runner feeds with
    (started in the lifespan); its blocking work has threads of its own."""
    st.batch_pool = executor()
    io = io_on(st.batch_pool)
    st.files = FileStore(st.redis, settings.batch_dir, retention_s=settings.batch_retention_s)
    st.batches = BatchStore(st.redis, retention_s=settings.batch_retention_s)
    st.batch_api = BatchAPI(st.files, st.batches, settings, io)
    st.feed_env = FeedEnv(st.jobs, st.waiter, settings, st.detok, st.limits, st.batches, st.files,
                          BatchLeases(st.redis, ttl_s=settings.batch_lease_ttl_s), io)


async def _sample_drain(admission: Admission) -> None:
    # The drain rate behind Retry-After: one sample of the drained-jobs counter a second.
    while True:
        with contextlib.suppress(Exception):
            await run_in_threadpool(admission.sample_drain)
        await asyncio.sleep(1.0)


@asynccontextmanager
async def _lifespan(app: FastAPI):
    st = app.state
    task = asyncio.create_task(_sample_drain(st.admission))
    runner = BatchRunner(st.feed_env, scan_s=st.settings.batch_scan_interval_s).start() \
        if st.settings.batch_feeder else None
    st.batch_runner = runner
    yield
    task.cancel()
    if runner is not None:
        await runner.close()
    st.batch_pool.shutdown(wait=False, cancel_futures=True)
    await st.waiter.close()
    await st.streams.close()
    st.depths.close()
    st.redis.close()
