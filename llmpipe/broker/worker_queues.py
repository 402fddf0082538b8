"""The queues of single inference workers (``inference~<node>``, llmpipe/stages.py) on either
broker: how they are declared, and how what waits in a dead worker's queue goes back to its
model's shared queue, where every other worker takes it.

* Redis: the consuming channel records that its lease consumes the queue (``OWNERS_KEY``,
  llmpipe/broker/redis_transport.py). The lease sweep that any live consumer runs every
  lease_sweep_interval_s (llmpipe/broker/leases.py) puts the messages a dead lease held
  straight on the shared queue, and then drains every worker queue whose owning lease is
  gone or expired to the front of the shared queue (``DRAIN_LUA``): a dead worker's own
  queue outlives its lease by one sweep at most. An entry is forgotten once its lease was
  swept, its queue is empty and its routing membership ended ``FORGET_AFTER_S`` ago
  (nothing routed there is still on its way). A message restored by a worker (a reject with requeue) goes to the shared
  queue too: the worker that gives a request back cannot serve it.
* RabbitMQ: no leases. A worker queue is a quorum queue whose messages wait at most
  lease_sweep_interval_s there, then RabbitMQ dead-letters them to the shared queue (at
  least once). A live worker takes its messages at once: routing never gives it more than
  it prefetches (its capacity, llmpipe/routing/router.py), so nothing of a live worker's
  waits that long but in a moment of lag. RabbitMQ hands a dead consumer's unacked messages
  back to their queue when its connection drops, where they are older than that already;
  and routing stops once the dead worker's membership expires (lease_ttl_s), so its queue
  outlives it by lease_sweep_interval_s, as on Redis.
"""

from __future__ import annotations

from typing import Any

from celery.app import amqp as celery_amqp
from kombu import Exchange, Queue

from llmpipe.broker.leases import CLOCK_LUA, LEASES_KEY, WAKE_PREFIX, now_arg
from llmpipe.jobs.lanes import PRIORITY_SEP, PRIORITY_STEPS
from llmpipe.routing.keys import MEMBERS_KEY
from llmpipe.settings import get_settings
from llmpipe.stages import WORKER_QUEUE_SEP, is_worker_queue, shared_queue

# hash: worker queue -> the lease of the channel that consumes it
OWNERS_KEY = "llmpipe:worker-queue-owners"
# How long after its routing membership ended a dead worker's queue is still watched: a
# request routed there in the membership's last moment is published a moment later.
FORGET_AFTER_S = 60

# KEYS: owners, leases, routing members. ARGV: now|'', wake prefix, worker queue separator,
# grace, then the lists' suffixes per priority step ('' for step 0). Replies {queue, moved, ...}.
DRAIN_LUA = CLOCK_LUA + """
local now = clock(ARGV[1])
local out = {}
local e = redis.call('HGETALL', KEYS[1])
for i = 1, #e, 2 do
  local q, lease = e[i], e[i + 1]
  local exp = redis.call('ZSCORE', KEYS[2], lease)
  if not exp or tonumber(exp) <= now then
    local shared = string.sub(q, 1, string.find(q, ARGV[3], 1, true) - 1)
    local moved = 0
    for s = 5, #ARGV do
      local items = redis.call('LRANGE', q .. ARGV[s], 0, -1)
      if #items > 0 then
        -- newest first: each RPUSH lands in front of the one before, so the oldest is frontmost
        for _, m in ipairs(items) do
          redis.call('RPUSH', shared .. ARGV[s], m)
          redis.call('LPUSH', ARGV[2] .. shared, '1')
        end
        redis.call('DEL', q .. ARGV[s])
        moved = moved + #items
      end
    end
    local member = redis.call('ZSCORE', KEYS[3], q)
    if moved == 0 and not exp and (not member or tonumber(member) < now - tonumber(ARGV[4])) then
      redis.call('HDEL', KEYS[1], q)
    end
    if moved > 0 then
      table.insert(out, q)
      table.insert(out, moved)
    end
  end
end
return out
"""

_SUFFIXES = tuple("" if step == 0 else f"{PRIORITY_SEP}{step}" for step in PRIORITY_STEPS)


class Drainer:
    """``DRAIN_LUA`` on one Redis (the lease sweep's)."""

    def __init__(self, r: Any):
        self.r = r
        self._drain = r.register_script(DRAIN_LUA)

    def load_script(self) -> None:
        self.r.script_load(self._drain.script)

    def drain(self, now: float | None = None) -> list[tuple[str, int]]:
        """Move what waits in every worker queue of a dead lease to its shared queue:
        [(worker queue, messages moved)]."""
        out = self._drain(keys=[OWNERS_KEY, LEASES_KEY, MEMBERS_KEY],
                          args=[now_arg(now), WAKE_PREFIX, WORKER_QUEUE_SEP, FORGET_AFTER_S, *_SUFFIXES])
        return [(_s(out[i]), int(out[i + 1])) for i in range(0, len(out), 2)]

    def own(self, queues: list[str], lease_id: str) -> None:
        """Record that ``lease_id`` consumes these worker queues."""
        if queues:
            self.r.hset(OWNERS_KEY, mapping=dict.fromkeys(queues, lease_id))


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else v


def amqp_arguments(queue: str, ttl_s: float) -> dict[str, Any]:
    """RabbitMQ: a worker queue whose messages go to the shared queue after ``ttl_s``."""
    shared = shared_queue(queue)
    return {
        "x-queue-type": "quorum",
        "x-message-ttl": max(1, int(ttl_s * 1000)),
        # the shared queue's own topic exchange and routing key (celeryconfig._rabbitmq)
        "x-dead-letter-exchange": shared,
        "x-dead-letter-routing-key": shared,
        # at least once: a message is dropped from here only once the shared queue has it
        "x-dead-letter-strategy": "at-least-once",
        "x-overflow": "reject-publish",
    }


def declaration(name: str) -> Queue:
    """A worker queue as both its consumer and the preprocess that routes to it declare it."""
    s = get_settings()
    if not s.broker_is_amqp:
        return Queue(name, Exchange(name), routing_key=name)
    return Queue(name, Exchange(name, type="topic"), routing_key=name,
                 queue_arguments=amqp_arguments(name, s.lease_sweep_interval_s))


class Queues(celery_amqp.Queues):
    """Celery's queue table, which creates the queues it does not know when they are first
    named; a worker queue comes with its own declaration."""

    def new_missing(self, name):
        return declaration(name) if is_worker_queue(name) else super().new_missing(name)


class AMQP(celery_amqp.AMQP):
    """The app's AMQP (llmpipe/celery_app.py): Celery's, with the queue table above."""

    queues_cls = Queues
