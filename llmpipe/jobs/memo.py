"""Stage results kept by request id, so that a redelivered message changes nothing.

With ``acks_late`` a message whose worker died (kill -9, OOM, engine death) is delivered
again, and the stage runs again. Celery's chord counter already ignores a second return of
the same header task (``CHORD_PART_RETURN_LUA`` keys it on the task id), so the chord is
never corrupted; but a second run of inference would cost engine time and could produce a
*different* generation (sampling). So each stage that is expensive or non-deterministic
runs through :class:`StageMemo`:

1. ``begin``: one round trip counts the delivery; a redelivery (count > 1) then reads the
   result stored for this (request, stage), if any;
2. a stored result is returned as is (a *replay*): the engine does not run again;
3. otherwise the stage runs and ``finish`` stores its result with HSETNX: the first
   result stored wins, and a concurrent duplicate returns the winner, never its own; a
   duplicate in the same process (a message redelivered while it still runs there) waits
   for the run in progress instead of running too.

One Redis hash per request (``llmpipe:idem:{request_id}``) holds every stage's result and
delivery count. It expires at the job's deadline plus ``slack_s`` (the longest a message
can wait for redelivery), and the chord callback deletes it when the job is collected, so
Redis holds these only for jobs in flight.

A request delivered more than ``max_deliveries`` times, each time losing its worker, is a
poison pill (it kills the engine every time): ``run`` stops running it and returns what
``over_limit`` builds, which the caller also dead-letters.

Redis errors here never fail a stage: without the memo the stage still runs (at worst
twice), which is the behaviour without idempotency.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from contextvars import ContextVar
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

log = logging.getLogger("llmpipe.jobs.memo")

_KEY = "llmpipe:idem:{}"

# The delivery count of the message whose stage ``StageMemo.run`` computes (0: unknown), so
# that a stage can tell a redelivery (inference then resumes from what was streamed).
DELIVERY: ContextVar[int] = ContextVar("llmpipe_delivery", default=0)


class Outcome(StrEnum):
    COMPUTED = "computed"  # this run's result was stored and returned
    REPLAYED = "replayed"  # an earlier run's result was returned; nothing ran
    LOST_RACE = "lost_race"  # this run computed, but a concurrent duplicate stored first; its result was returned
    COALESCED = "coalesced"  # a duplicate running in this process at the same time: waited for its result
    OVER_LIMIT = "over_limit"  # delivered too often: not run, ``over_limit``'s result returned


@dataclass(frozen=True)
class Claim:
    stored: dict | None
    deliveries: int  # including this one; 0 when Redis could not be asked


def memo_key(request_id: str) -> str:
    return _KEY.format(request_id)


class StageMemo:
    def __init__(self, r: Any, *, slack_s: float, max_deliveries: int = 3, clock: Callable[[], float] = time.time):
        self.r = r
        self.slack_s = slack_s
        self.max_deliveries = max_deliveries
        self._clock = clock
        self._inflight: dict[str, Future] = {}  # this process's runs in progress
        self._lock = threading.Lock()

    def begin(self, stage: str, request_id: str, deadline: float) -> Claim:
        key = memo_key(request_id)
        try:
            pipe = self.r.pipeline(transaction=False)
            pipe.hincrby(key, f"{stage}:n", 1)
            pipe.expireat(key, int(max(deadline, self._clock()) + self.slack_s) + 1)
            n, _ = pipe.execute()
            # A first delivery finds nothing stored: whatever stored a result counted its
            # own delivery first. Only a later one reads (one more round trip, rare).
            raw = self.r.hget(key, stage) if int(n) > 1 else None
        except Exception as exc:  # redis trouble: run without the memo
            log.warning("request=%s stage=%s memo unavailable (%s); running without it", request_id, stage, exc)
            return Claim(None, 0)
        return Claim(json.loads(raw) if raw else None, int(n))

    def finish(self, stage: str, request_id: str, value: dict) -> tuple[dict, bool]:
        """Store ``value`` unless a result is already stored; return (the stored result, ours?)."""
        key = memo_key(request_id)
        try:
            if self.r.hsetnx(key, stage, json.dumps(value, separators=(",", ":"))):
                return value, True
            raw = self.r.hget(key, stage)  # a duplicate stored first (rare): its result wins
        except Exception as exc:
            log.warning("request=%s stage=%s result not memoised (%s)", request_id, stage, exc)
            return value, True
        if not raw:
            return value, True
        return json.loads(raw), False

    def run(self, stage: str, request_id: str, deadline: float, compute: Callable[[], dict],
            over_limit: Callable[[int], dict] | None = None) -> tuple[dict, Outcome]:
        claim = self.begin(stage, request_id, deadline)
        if claim.stored is not None:
            log.info("request=%s stage=%s replayed the stored result (delivery %d)", request_id, stage, claim.deliveries)
            return claim.stored, Outcome.REPLAYED
        if over_limit is not None and self.max_deliveries > 0 and claim.deliveries > self.max_deliveries:
            log.error("request=%s stage=%s delivered %d times (max_deliveries=%d): not running it again",
                      request_id, stage, claim.deliveries, self.max_deliveries)
            value, _ = self.finish(stage, request_id, over_limit(claim.deliveries))
            return value, Outcome.OVER_LIMIT
        # The same message twice in this process at once (delivered again while it still
        # runs here): the second waits for the first instead of running the stage again.
        key = f"{stage}:{request_id}"
        with self._lock:
            running = self._inflight.get(key)
            if running is None:
                mine: Future = Future()
                self._inflight[key] = mine
        if running is not None:
            try:
                value = running.result(timeout=max(1.0, deadline - self._clock() + 5.0))
                log.info("request=%s stage=%s duplicate joined the run in progress", request_id, stage)
                return value, Outcome.COALESCED
            except Exception:  # the first run failed or hangs: run it here
                return self._compute(stage, request_id, compute, claim.deliveries)
        try:
            value, how = self._compute(stage, request_id, compute, claim.deliveries)
            mine.set_result(value)
            return value, how
        except BaseException as exc:
            mine.set_exception(exc)
            raise
        finally:
            with self._lock:
                self._inflight.pop(key, None)

    def _compute(self, stage: str, request_id: str, compute: Callable[[], dict], deliveries: int = 0) -> tuple[dict, Outcome]:
        token = DELIVERY.set(deliveries)
        try:
            computed = compute()
        finally:
            DELIVERY.reset(token)
        value, ours = self.finish(stage, request_id, computed)
        if not ours:
            log.warning("request=%s stage=%s ran twice at once; returning the result stored first", request_id, stage)
        return value, Outcome.COMPUTED if ours else Outcome.LOST_RACE

    def forget(self, request_ids: Iterable[str]) -> None:
        keys = [memo_key(r) for r in request_ids]
        if not keys:
            return
        try:
            self.r.delete(*keys)
        except Exception as exc:  # they expire anyway
            log.warning("could not delete %d memo keys (%s); they expire on their own", len(keys), exc)
