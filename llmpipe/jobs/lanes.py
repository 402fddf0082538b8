"""Priority lanes: a request's ``priority`` (vLLM's field: an int, default 0, lower is
sooner) picks its lane, and the lane picks its broker priority and its admission budget.

* ``interactive``: priority below ``lane_batch_priority`` (the default 0 included). On Redis
  broker priority 0, the list every consumer claims from first; admitted up to the full limits.
* ``batch``: priority ``lane_batch_priority`` or more. On Redis broker priority 9, claimed
  only when every interactive list of the queue is empty; admitted only while the stage queues and
  the queued tokens are under ``lane_batch_share`` of the limits, so a batch backlog gets
  429 while interactive requests still have the rest.

Inside the inference worker the raw priority orders the batcher's pending requests, and
vLLM (``scheduling_policy="priority"``) schedules by it: the order holds end to end. On a
continuous engine the batch lane also runs in at most ``lane_batch_slot_share`` of the engine's
running slots (vLLM's ``max_num_seqs``, or the requests the worker holds where those are fewer;
workers/inference_runtime.py): vLLM admits waiting requests by
priority, but it preempts a running one only when the KV cache is short, never for a
waiting request of higher priority, and every running request shares each step, batch-lane
prefills included: the share keeps a slot free for an interactive request and bounds the
batch work its steps carry, and ``lane_batch_starting`` of those are in their prefill at once
(batch requests of one length that start together end together, and their successors'
prefills would share one step). On Redis every consumer likewise holds batch-lane messages in at
most that share of its prefetch (:class:`BatchClaims`), so an interactive message always finds
a thread to take it. Both hold for ``lane_slot_hold_s`` after the last interactive request;
between interactive requests a Redis consumer still leaves ``lane_interactive_reserve`` of its
prefetch to them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import StrEnum

# The range the API accepts (vLLM takes any int; a bound keeps the schema honest and the
# value in every engine's int).
PRIORITY_MIN = -1000
PRIORITY_MAX = 1000

# kombu's Redis priority lists (its default steps): a message of priority p goes to the list
# of the largest step <= p; 0 is claimed first.
PRIORITY_STEPS = (0, 3, 6, 9)
# kombu's separator between a queue's name and its priority step in the list's key.
PRIORITY_SEP = "\x06\x16"


class Lane(StrEnum):
    INTERACTIVE = "interactive"
    BATCH = "batch"


# kombu's Redis transport claims the lowest number first; AMQP delivers the highest first
# (RabbitMQ 4's quorum queues: above 4 is "high"; 3.10's quorum queues have no priorities
# and deliver both lanes in order, docs/architecture.md "Lanes").
BROKER_PRIORITY = {Lane.INTERACTIVE: 0, Lane.BATCH: 9}
AMQP_PRIORITY = {Lane.INTERACTIVE: 9, Lane.BATCH: 0}


def lane_for(priority: int, batch_priority: int) -> Lane:
    return Lane.BATCH if priority >= batch_priority else Lane.INTERACTIVE


def broker_priority(lane: Lane, amqp: bool = False) -> int:
    return (AMQP_PRIORITY if amqp else BROKER_PRIORITY)[lane]


def lane_of_message(properties: dict | None) -> Lane:
    """The lane of a message on the Redis broker, from its properties' broker priority (a
    message without one, as a plain Celery task, is interactive)."""
    pri = (properties or {}).get("priority") or 0
    return Lane.BATCH if pri >= BROKER_PRIORITY[Lane.BATCH] else Lane.INTERACTIVE


def queue_keys(queue: str, lane: Lane | None = None) -> list[str]:
    """Every Redis list that holds ``queue``'s messages (of ``lane`` only, when given), in the
    order consumers claim them."""
    steps = [st for st in PRIORITY_STEPS if lane is None or lane_of_message({"priority": st}) is lane]
    return [queue if step == 0 else f"{queue}{PRIORITY_SEP}{step}" for step in steps]


def batch_lane_slots(share: float, running_slots: int) -> int:
    """The engine's running slots the batch lane may hold (at least one: it never starves)."""
    return max(1, int(share * running_slots))


def interactive_reserve(reserve: float, prefetch: int) -> int:
    """The slots of a consumer's prefetch that batch-lane messages never take: ``reserve`` of
    it, rounded down, and never the last slot. Rounded down, because a small prefetch is a
    CPU stage's prefork pool (2 slots by default), whose tasks take milliseconds: there one
    slot held back would halve the batch's concurrency to save an interactive task a few
    milliseconds; the inference worker's 256 slots on vLLM (tasks of seconds) keep 16."""
    if prefetch <= 1:
        return 0
    return min(prefetch - 1, int(reserve * prefetch))


class BatchClaims:
    """Whether a consumer may take one more batch-lane message (the Redis transport asks it
    before each claim: llmpipe/broker/redis_transport.py).

    A worker takes messages up to its prefetch, one per thread of the inference worker's
    pool. Left alone, a batch backlog fills every one of them, and an interactive message
    then waits in its queue, first in line but with no thread to take it, until a batch
    request ends: measured at 4.7 s (median) per interactive job under a draining batch.
    So, for ``hold_s`` after the consumer last took an interactive message, it holds
    batch-lane messages in at most ``lane_batch_slot_share`` of its prefetch
    (:func:`batch_lane_slots`) and takes only interactive ones beyond that; the rest of the
    prefetch stays free for them.

    Between interactive messages a batch-only load keeps the prefetch but ``reserve`` of it
    (:func:`interactive_reserve`): without that, the first interactive messages after a
    quiet spell found every thread held by the batch and waited for batch requests to end,
    up to 5.7 s in the queue, until the hold above freed threads.
    """

    def __init__(self, share: float, hold_s: float, clock: Callable[[], float] = time.monotonic,
                 reserve: float = 0.0):
        self.share = share
        self.hold_s = hold_s
        self.reserve = reserve
        self._clock = clock
        self._interactive_at: float | None = None

    def interactive_taken(self, now: float | None = None) -> None:
        if now is None:
            now = self._clock()
        self._interactive_at = now

    def open(self, held: int, prefetch: int, now: float | None = None) -> bool:
        """``held``: batch-lane messages the consumer holds; ``prefetch``: how many it may
        hold in all (0: no limit, and no share of it either)."""
        if now is None:
            now = self._clock()
        if prefetch <= 0:
            return True
        recent = self._interactive_at is not None and now - self._interactive_at < self.hold_s
        if recent:
            return held < batch_lane_slots(self.share, prefetch)
        kept = interactive_reserve(self.reserve, prefetch)
        return kept == 0 or held < prefetch - kept  # the prefetch itself is the QoS's to enforce
