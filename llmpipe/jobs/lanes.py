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
continuous engine the batch lane also runs in at most ``lane_batch_share`` of the engine's
running slots (vLLM's ``max_num_seqs``, or the requests the worker holds where that is more;
workers/inference_runtime.py): vLLM admits waiting requests by
priority, but it preempts a running one only when the KV cache is short, never for a
waiting request of higher priority, and every running request shares each step, batch-lane
prefills included: the share keeps a slot free for an interactive request and bounds the
batch work its steps carry.
"""

from __future__ import annotations

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


def queue_keys(queue: str) -> list[str]:
    """Every Redis list that holds ``queue``'s messages, in the order consumers claim them."""
    return [queue if step == 0 else f"{queue}{PRIORITY_SEP}{step}" for step in PRIORITY_STEPS]


def batch_lane_slots(share: float, running_slots: int) -> int:
    """The engine's running slots the batch lane may hold (at least one: it never starves)."""
    return max(1, int(share * running_slots))
