"""Noticing a client that went away while a non-streaming request waits (vLLM's
``with_cancellation``): the wait races the ASGI ``http.disconnect`` message. The server
does not cancel a plain handler when its client leaves, so without this a gone client's
job would run to the end. (Streams: ``JobStream`` in api/openai/sse.py.)"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
from fastapi import Request
from starlette.concurrency import run_in_threadpool

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


async def _disconnected(request: Request) -> None:
    # The body was read before the handler ran, so the next message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T], on_gone: Callable[[], object]) -> T:
    """``work``'s result; if the client disconnects first, ``work`` is cancelled,
    ``on_gone`` runs in a thread (shielded from cancellation) and ClientGone is raised."""
    work_task = asyncio.ensure_future(work)
    gone_task = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work_task, gone_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work_task.done() and not gone_task.done():  # we were cancelled ourselves
            work_task.cancel()
        gone_task.cancel()
    if work_task.done():
        return work_task.result()
    work_task.cancel()
    with contextlib.suppress(BaseException):
        await work_task
    with anyio.move_on_after(10, shield=True):
        await run_in_threadpool(on_gone)
    raise ClientGone
