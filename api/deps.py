"""The API's collaborators as FastAPI dependencies. create_app (api/app.py) makes each one
once and keeps it on ``app.state``; a handler names what it needs by type (``jobs: Jobs``)
and FastAPI hands it the app's own. A test app gets its own, so apps never share one.

The functions are ``async`` so that FastAPI calls them on the event loop, not in a thread.
"""

from __future__ import annotations

from typing import Annotated

import redis
from celery import Celery
from fastapi import Depends, Request
from prometheus_client import CollectorRegistry

from api.batches.service import BatchAPI
from api.detok import Detokenizers
from api.jobs.service import JobService
from api.openai.service import OpenAIServing
from api.waiter import JobWaiter
from llmpipe.jobs.deadletter import DeadLetters
from llmpipe.models.served import ModelSet
from llmpipe.settings import Settings


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_served(request: Request) -> ModelSet:
    """The served models (llmpipe/models/served.py), read from the settings once per app."""
    return request.app.state.served


async def get_api_keys(request: Request) -> frozenset[str]:
    return request.app.state.api_keys


async def get_jobs(request: Request) -> JobService:
    return request.app.state.jobs


async def get_waiter(request: Request) -> JobWaiter:
    return request.app.state.waiter


async def get_detokenizers(request: Request) -> Detokenizers:
    return request.app.state.detok


async def get_redis(request: Request) -> redis.Redis:
    return request.app.state.redis


async def get_celery(request: Request) -> Celery:
    return request.app.state.celery


async def get_deadletters(request: Request) -> DeadLetters:
    return request.app.state.deadletters


async def get_registries(request: Request) -> list[CollectorRegistry]:
    """What ``/metrics`` answers (api/ops/metrics.py build_registries)."""
    return request.app.state.registries


async def get_openai(request: Request) -> OpenAIServing:
    """The OpenAI endpoints' service, on this app's collaborators (it holds no state of its own)."""
    st = request.app.state
    return OpenAIServing(st.jobs, st.waiter, st.settings, st.detok, st.streams)


async def get_batches(request: Request) -> BatchAPI:
    """The Files and Batches endpoints' service (api/batches/service.py)."""
    return request.app.state.batch_api


AppSettings = Annotated[Settings, Depends(get_settings)]
Served = Annotated[ModelSet, Depends(get_served)]
ApiKeys = Annotated[frozenset[str], Depends(get_api_keys)]
Jobs = Annotated[JobService, Depends(get_jobs)]
Waiter = Annotated[JobWaiter, Depends(get_waiter)]
Detoks = Annotated[Detokenizers, Depends(get_detokenizers)]
Redis = Annotated[redis.Redis, Depends(get_redis)]
CeleryApp = Annotated[Celery, Depends(get_celery)]
DeadLetterLog = Annotated[DeadLetters, Depends(get_deadletters)]
Registries = Annotated[list[CollectorRegistry], Depends(get_registries)]
OpenAI = Annotated[OpenAIServing, Depends(get_openai)]
Batches = Annotated[BatchAPI, Depends(get_batches)]
