"""An inference worker's membership in prefix-aware routing (llmpipe/routing/members.py),
started once its engine is up: its own queue, its capacity, its engine's block size, what it
holds now (every request Celery reserved for it, running or waiting in the batcher), and its
model's backlog (the interactive requests waiting in the shared queue; on RabbitMQ, which
does not count a queue by priority, every request waiting there)."""

from __future__ import annotations

import logging
from typing import Any

from celery.worker import state as worker_state

from llmpipe.broker.queue_depth import AmqpDepths
from llmpipe.jobs.lanes import Lane, queue_keys
from llmpipe.routing.members import RouteMember
from llmpipe.routing.router import DEFAULT_BLOCK_SIZE
from llmpipe.settings import Settings
from llmpipe.stages import shared_queue

log = logging.getLogger("llmpipe.worker")


def held_requests() -> int:
    """The requests this worker process holds: received from the broker and not finished."""
    return len(worker_state.reserved_requests)


def engine_block_size(engine: Any, s: Settings) -> int:
    """The token block routing hashes over: the setting, else the engine's KV-cache block."""
    return s.route_block_size or getattr(engine, "block_size", None) or DEFAULT_BLOCK_SIZE


def start_member(engine: Any, r: Any, s: Settings, queue: str, capacity: int) -> RouteMember:
    """The membership of the worker consuming ``queue``, renewed by a thread from now on."""
    shared = shared_queue(queue)
    keys: list[str] = []
    shared_keys: list[str] = []
    queued = waiting = _none
    if s.broker_is_amqp:
        depths = AmqpDepths(s.effective_broker_url)
        queued, waiting = _amqp_depth(depths, queue, shared), _amqp_depth(depths, shared, queue)
    else:  # counted inside the report script
        keys, shared_keys = queue_keys(queue), queue_keys(shared, Lane.INTERACTIVE)
    member = RouteMember(r, queue, capacity=capacity, block_size=engine_block_size(engine, s), ttl_s=s.lease_ttl_s,
                         held=held_requests, queued=queued, queue_keys=keys, shared=shared, waiting=waiting,
                         shared_keys=shared_keys)
    log.info("routing: this worker takes requests on %s too (holds %d at once, blocks of %d tokens)", queue, capacity,
             member.block_size)
    return member.start()


def _none() -> int:
    return 0


def _amqp_depth(depths: AmqpDepths, queue: str, other: str):
    """``queue``'s depth, read with ``other``'s, so that one report reads the broker once."""
    def queued() -> int:
        try:
            return depths.sample((queue, other)).depths[queue]
        except Exception:  # RabbitMQ away for a moment: the membership must still be renewed
            log.debug("could not read the depth of %s", queue, exc_info=True)
            return 0

    return queued
