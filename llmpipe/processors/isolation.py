"""Batch failure isolation: a failed batch is split and retried down to single requests.

Ray Serve and BentoML fail a whole batch when one request breaks it. Here a poison
request fails alone, transient errors (e.g. out of memory) are retried with backoff, and
only a dead engine takes the batch down (the worker then exits and Celery redelivers).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

from tenacity import RetryError, Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from llmpipe.errors import EngineDeadError, EngineError

log = logging.getLogger(__name__)

Req = TypeVar("Req")
Res = TypeVar("Res")


def _transient(exc: BaseException) -> bool:
    return isinstance(exc, EngineError) and exc.transient and not isinstance(exc, EngineDeadError)


def run_isolated(
    generate: Callable[[list[Req]], list[Res]],
    batch: Sequence[Req],
    *,
    attempts: int = 3,
    backoff_s: float = 0.05,
    sleep: Callable[[float], None] | None = None,
    on_split: Callable[[int], None] | None = None,
) -> list[Res | EngineError]:
    """Run ``batch``; return one result or EngineError per request, in order."""
    batch = list(batch)
    if not batch:
        return []
    try:
        return list(generate(batch))
    except EngineDeadError:
        raise
    except EngineError as exc:
        if len(batch) == 1:
            return [_retry_single(generate, batch[0], exc, attempts, backoff_s, sleep)]
        log.warning("batch of %d failed (%s); splitting to isolate the failing request", len(batch), exc)
        if on_split is not None:
            on_split(len(batch))
        mid = len(batch) // 2
        kw = dict(attempts=attempts, backoff_s=backoff_s, sleep=sleep, on_split=on_split)
        return run_isolated(generate, batch[:mid], **kw) + run_isolated(generate, batch[mid:], **kw)


def _retry_single(generate, req, first: EngineError, attempts: int, backoff_s: float, sleep) -> Res | EngineError:
    if not first.transient or attempts <= 1:
        return first
    kwargs = {}
    if sleep is not None:
        kwargs["sleep"] = sleep
    retrying = Retrying(
        stop=stop_after_attempt(attempts - 1),
        wait=wait_exponential(multiplier=backoff_s, max=2.0),
        retry=retry_if_exception(_transient),
        reraise=False,
        **kwargs,
    )
    try:
        return retrying(lambda: generate([req]))[0]
    except RetryError as exc:
        last = exc.last_attempt.exception()
        return last if isinstance(last, EngineError) else EngineError(str(last))
    except EngineDeadError:
        raise
    except EngineError as exc:
        return exc
