"""The Redis keys of prefix-aware routing (llmpipe/routing/). They live on the broker's Redis
when the broker is Redis (the lease sweep reads the members next to the leases,
llmpipe/broker/worker_queues.py), else on ``redis_url``."""

from __future__ import annotations

_PREFIX = "llmpipe:route:"
# zset: worker queue -> until when the worker is live (Redis server time), renewed by the worker
MEMBERS_KEY = _PREFIX + "members"
# hash: worker queue -> requests it holds or that wait in its own queue (preprocess adds one
# per request it routes there; the worker sets the true count several times a second)
LOAD_KEY = _PREFIX + "load"
# hash: worker queue -> "<capacity> <block size>": the most requests it holds at once, and
# its engine's KV-cache block size in tokens
INFO_KEY = _PREFIX + "info"
# hash: a model's shared queue -> interactive requests waiting there (preprocess adds one per
# request it sends there for want of room; the workers set the true count several times a second)
BACKLOG_KEY = _PREFIX + "backlog"


def prefix_key(shared_queue: str, digest: str) -> str:
    """Where a prompt prefix (its hash) of the model on ``shared_queue`` last went."""
    return f"{_PREFIX}prefix:{shared_queue}:{digest}"


def routing_redis_url(s) -> str:
    """Where these keys live for settings ``s``: the broker's Redis when the broker is Redis
    (the lease sweep drains worker queues by them), else ``redis_url``."""
    return s.redis_url if s.broker_is_amqp else s.effective_broker_url
