"""Celery configuration, loaded by string: ``app.config_from_object("celeryconfig")``.

Values that vary per deployment come from the typed llmpipe Settings (LLMPIPE_* env).
``build(settings)`` makes every value from one Settings object; this module's names are
``build(get_settings())``, and the API applies ``build`` of its own settings object
(api/app.py), so both read one definition.
"""

from __future__ import annotations

from typing import Any

from kombu import Exchange, Queue

from llmpipe.broker.redis_clients import celery_url, is_sentinel, sentinel_transport_options
from llmpipe.broker.redis_transport import transport_for
from llmpipe.jobs.lanes import PRIORITY_STEPS
from llmpipe.settings import Settings, get_settings
from llmpipe.stages import COLLECT, COLLECT_TASK, TOKENIZE_TASK, Stage, inference_queue

# Workers import these; the API never does (it sends tasks by name).
_IMPORTS = ("workers.signals", "tasks.preprocess", "tasks.inference", "tasks.postprocess", "tasks.collect",
           "tasks.tokenize")

# What does not vary per deployment.
_FIXED: dict[str, Any] = {
    "imports": _IMPORTS,
    "task_default_queue": Stage.PREPROCESS.value,
    # JSON only: a worker never unpickles what it receives.
    "task_serializer": "json",
    "result_serializer": "json",
    "accept_content": ["json"],
    "result_accept_content": ["json"],
    "task_track_started": False,  # one STARTED write per task would double backend traffic
    # Ack after the task returns, so a crashed worker's messages are redelivered, not lost.
    "task_acks_late": True,
    # A worker process that dies mid-task (kill -9, OOM) requeues the message instead of failing it.
    "task_reject_on_worker_lost": True,
    # One reserved message per process on the CPU pools so a slow task never hoards work;
    # the inference worker raises it per worker (workers/launch.py) to fill its batches.
    "worker_prefetch_multiplier": 1,
    "broker_connection_retry_on_startup": True,
    # A worker whose broker went away tries again every second, for as long as it takes
    # (kombu's own waits grow to 30 s: after a Redis restart the workers came back up to that
    # much later than Redis did; workers/consumer.py).
    "worker_consumer": "workers.consumer:Consumer",
    "broker_connection_timeout": 4,
    # Publishing fails fast instead of blocking an API request while Redis is down.
    "task_publish_retry_policy": {"max_retries": 2, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.5},
    "redis_socket_timeout": 5,
    "redis_socket_connect_timeout": 3,
    "redis_retry_on_timeout": True,
    "broker_pool_limit": 32,
    "worker_hijack_root_logger": False,
    # What a worker's libraries print (vLLM logs to stdout, progress bars) is logged at INFO, not
    # as WARNING: `llmpipe up` shows workers' warnings, and vLLM's own WARNING lines keep their
    # level in the text (llmpipe/local/console_filter.py reads it).
    "worker_redirect_stdouts_level": "INFO",
    "worker_cancel_long_running_tasks_on_connection_loss": False,
}


def _backends(s: Settings) -> dict[str, Any]:
    return {
        # LLMPIPE_BROKER_URL; unset: Redis at redis_url. A sentinel:// URL goes to the Sentinel
        # transport (broker) and Celery's Sentinel backend, with the master's name in the
        # transport options.
        "broker_url": celery_url(s.effective_broker_url),
        # kombu's Redis transport with worker leases (its Sentinel twin for sentinel://): a dead
        # worker's messages come back within lease_ttl_s + lease_sweep_interval_s, a live
        # worker's never (llmpipe/broker/redis_transport.py). None (RabbitMQ): the URL's own transport.
        "broker_transport": transport_for(s.effective_broker_url),
        # Celery's Redis (or Sentinel) backend, with a bounded retry and a defined end when Redis is
        # down after a task's body (llmpipe/broker/result_backend.py): the message is never left unacked.
        "result_backend": ("llmpipe.broker.result_backend:OutcomeSentinelBackend+" if is_sentinel(s.redis_url)
                           else "llmpipe.broker.result_backend:OutcomeRedisBackend+") + celery_url(s.redis_url),
        # Job results live this long; the API's job records share the same TTL.
        "result_expires": s.result_ttl_s,
        "result_backend_transport_options": {
            "retry_policy": {"timeout": 5.0},
            **sentinel_transport_options(s.redis_url, s.redis_sentinel_master, socket_timeout=5,
                                         socket_connect_timeout=3)},
        # Flower and the tests watch task events (LLMPIPE_TASK_EVENTS=false trades Flower's view for CPU).
        "worker_send_task_events": s.task_events,
        "task_send_sent_event": s.task_events,
    }


def _routes(s: Settings) -> dict[str, Any]:
    # Several models (llmpipe/models/served.py): each has its own inference queue,
    # inference.<name>, so each is served and scaled on its own; the API names the queue when it
    # sends a job. "inference" stays declared: with one model it is that model's queue.
    models = s.served
    pre, post = Stage.PREPROCESS.value, Stage.POSTPROCESS.value
    return {
        "task_queues": (
            Queue(pre),
            *(Queue(q) for q in dict.fromkeys((inference_queue(None), *models.inference_queues))),
            Queue(post),
            Queue(COLLECT),
        ),
        "task_routes": {
            Stage.PREPROCESS.task: {"queue": pre},
            Stage.INFERENCE.task: {"queue": models.default.queue},
            Stage.POSTPROCESS.task: {"queue": post},
            COLLECT_TASK: {"queue": COLLECT},
            TOKENIZE_TASK: {"queue": pre},  # POST /tokenize: the stage that tokenizes answers
        },
    }


def _redis_transport_options(s: Settings) -> dict[str, Any]:
    return {
        # Priority lanes (llmpipe/jobs/lanes.py): each queue is one list per step, and consumers
        # claim from the lowest step first (0: interactive, 9: batch), so a batch backlog never
        # sits in front of an interactive request.
        "priority_steps": list(PRIORITY_STEPS),
        "queue_order_strategy": "priority",
        # ... and, while interactive messages come, a consumer holds batch-lane ones in at most
        # this share of its prefetch, so one is free for the next interactive message.
        "lane_batch_slot_share": s.lane_batch_slot_share,
        "lane_slot_hold_s": s.lane_slot_hold_s,
        # ... and between interactive messages it leaves this share of its prefetch free all the
        # same, for the first interactive message after a quiet spell.
        "lane_interactive_reserve": s.lane_interactive_reserve,
        # A worker silent this long is dead; every consumer sweeps for dead ones this often.
        "lease_ttl": s.lease_ttl_s,
        "lease_sweep_interval": s.lease_sweep_interval_s,
        # The last resort, for a message that no live lease holds: redelivered after this many
        # seconds, by default longer than any job may live (max_timeout_s + 60).
        "visibility_timeout": max(1, int(s.effective_visibility_timeout_s)),
        # Scan for unacked messages of dead workers this often (kombu's default is ~100 s).
        "unacked_restore_interval": s.unacked_restore_interval_s,
        "unacked_restore_throttle": 1,
        # The sweep's mutex outlives a worker killed mid-sweep by this long (kombu: 300 s), and
        # that adds to the recovery time; a sweep takes milliseconds, and restores are
        # transactions, so overlapping sweeps are safe.
        "unacked_mutex_expire": int(min(30, max(2, s.effective_visibility_timeout_s / 5))),
        **sentinel_transport_options(s.effective_broker_url, s.redis_sentinel_master, socket_timeout=5,
                                     socket_connect_timeout=3),
    }


def _rabbitmq(queues: tuple[Queue, ...]) -> dict[str, Any]:
    """LLMPIPE_BROKER_URL=amqp://... (docs/reliability.md, "RabbitMQ"). RabbitMQ returns a
    dead consumer's unacked messages to the queue itself when its connection drops, so the
    Redis visibility options do not apply there."""
    return {
        # Quorum queues: replicated, durable, and they count deliveries (x-delivery-count).
        # Topic exchanges, because Celery's native delayed delivery (countdown/ETA on quorum
        # queues) routes through topic exchanges only.
        "task_queues": tuple(Queue(q.name, Exchange(q.name, type="topic"), routing_key=q.name,
                                   queue_arguments={"x-queue-type": "quorum"}) for q in queues),
        "task_default_queue_type": "quorum",
        # Quorum queues refuse a global QoS: Celery then sets the prefetch per consumer.
        "worker_detect_quorum_queues": True,
        # Publisher confirms: apply_async returns once RabbitMQ has the message, so a job
        # the API answered 202 for is in the queue, not in a socket buffer.
        "broker_transport_options": {"confirm_publish": True},
    }


def build(s: Settings) -> dict[str, Any]:
    """Every Celery setting of this app, from ``s``."""
    conf = {**_FIXED, **_backends(s), **_routes(s), "broker_transport_options": _redis_transport_options(s)}
    if s.broker_is_amqp:
        conf.update(_rabbitmq(conf["task_queues"]))
    return conf


# Celery reads this module's names (config_from_object); they are build() of the process's settings.
globals().update(build(get_settings()))
