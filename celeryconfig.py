"""Celery configuration, loaded by string: ``app.config_from_object("celeryconfig")``.

Values that vary per deployment come from the typed llmpipe Settings (LLMPIPE_* env).
"""

from kombu import Queue

from llmpipe.settings import get_settings

_s = get_settings()

broker_url = _s.redis_url
result_backend = _s.redis_url

# Workers import these; the API never does (it sends tasks by name).
imports = ("workers.signals", "tasks.preprocess", "tasks.inference", "tasks.postprocess", "tasks.collect", "tasks.tokenize")

task_queues = (
    Queue("preprocess"),
    Queue("inference"),
    Queue("postprocess"),
    Queue("collect"),
)
task_routes = {
    "llmpipe.preprocess": {"queue": "preprocess"},
    "llmpipe.inference": {"queue": "inference"},
    "llmpipe.postprocess": {"queue": "postprocess"},
    "llmpipe.collect": {"queue": "collect"},
    "llmpipe.tokenize": {"queue": "preprocess"},  # POST /tokenize: the stage that tokenizes answers
}
task_default_queue = "preprocess"

# JSON only: a worker never unpickles what it receives.
task_serializer = "json"
result_serializer = "json"
accept_content = ["json"]
result_accept_content = ["json"]

# Flower and the tests watch task events (LLMPIPE_TASK_EVENTS=false trades Flower's view for CPU).
worker_send_task_events = _s.task_events
task_send_sent_event = _s.task_events
task_track_started = False  # one STARTED write per task would double backend traffic

# Ack after the task returns, so a crashed worker's messages are redelivered, not lost.
task_acks_late = True
# A worker process that dies mid-task (kill -9, OOM) requeues the message instead of failing it.
task_reject_on_worker_lost = True
# One reserved message per process on the CPU pools so a slow task never hoards work;
# the inference worker raises it per worker (workers/launch.py) to fill its batches.
worker_prefetch_multiplier = 1

broker_transport_options = {
    # An unacked message is redelivered after this many seconds: by default longer than any
    # job may live (max_timeout_s + 60) so a slow but healthy task is never run twice
    # (settings.visibility_timeout_s overrides it; the reliability tests shorten it).
    "visibility_timeout": max(1, int(_s.effective_visibility_timeout_s)),
    # Scan for unacked messages of dead workers this often (kombu's default is ~100 s).
    "unacked_restore_interval": _s.unacked_restore_interval_s,
    "unacked_restore_throttle": 1,
    # The sweep's mutex outlives a worker killed mid-sweep by this long (kombu: 300 s), and
    # that adds to the recovery time; a sweep takes milliseconds, and restores are
    # transactions, so overlapping sweeps are safe.
    "unacked_mutex_expire": int(min(30, max(2, _s.effective_visibility_timeout_s / 5))),
}
# Job results live this long; the API's job records share the same TTL.
result_expires = _s.result_ttl_s
result_backend_transport_options = {"retry_policy": {"timeout": 5.0}}

broker_connection_retry_on_startup = True
broker_connection_timeout = 4
# Publishing fails fast instead of blocking an API request while Redis is down.
task_publish_retry_policy = {"max_retries": 2, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.5}
redis_socket_timeout = 5
redis_socket_connect_timeout = 3
redis_retry_on_timeout = True
broker_pool_limit = 32

worker_hijack_root_logger = False
# What a worker's libraries print (vLLM logs to stdout, progress bars) is logged at INFO, not
# as WARNING: `llmpipe up` shows workers' warnings, and vLLM's own WARNING lines keep their
# level in the text (llmpipe/console_filter.py reads it).
worker_redirect_stdouts_level = "INFO"
worker_cancel_long_running_tasks_on_connection_loss = False
