"""Worker lifecycle hooks: warm the engine (or the tokenizer) at start, release it on
shutdown. A worker that cannot warm prints one ``llmpipe:`` line and exits with code 3
(ExitCode.CANNOT_WARM), which ``llmpipe up`` reports as the reason it cannot serve."""

from __future__ import annotations

import logging
import os
import sys
import threading

import redis
from celery.signals import (
    task_failure,
    worker_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)
from kombu.transport import redis as kombu_redis

from llmpipe.broker.redis_clients import from_settings
from llmpipe.broker.requeue import requeued_on
from llmpipe.celery_app import app
from llmpipe.jobs.deadletter import DeadLetters
from llmpipe.jobs.store import JobStore
from llmpipe.jobs.watchdog import Watchdog, WatchdogLoop
from llmpipe.observability.heap import freeze_heap
from llmpipe.observability.readiness import STAGES, ReadinessBeacon
from llmpipe.settings import get_settings
from llmpipe.stages import COLLECT, ExitCode, Stage
from workers import hook, task_logging
from workers.context import context
from workers.load_stop import stop_loading_worker
from workers.pool_policy import serves  # its worker_init (pool, kind) runs before the ones below

log = logging.getLogger("llmpipe.worker")

EXIT_CANNOT_WARM = ExitCode.CANNOT_WARM
_PRE, _INF, _POST = Stage.PREPROCESS.value, Stage.INFERENCE.value, Stage.POSTPROCESS.value


task_logging.install(context().settings.log_content)


def one_line(exc: BaseException, limit: int = 400) -> str:
    """``Type: message`` on one line, at most ``limit`` chars."""
    text = " ".join(str(exc).split())
    line = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _cannot_warm(what: str, exc: BaseException) -> None:
    line = f"llmpipe: {what} could not start: {one_line(exc)}"
    log.critical("%s", line.removeprefix("llmpipe: "), exc_info=True)
    # The real stderr: Celery redirects sys.stderr into its logger.
    print(line, file=sys.__stderr__, flush=True)
    os._exit(EXIT_CANNOT_WARM)


@worker_init.connect
def _declare_stage_queues(sender=None, **_):
    # RabbitMQ: Celery binds every stage queue's exchange to its delayed-delivery exchanges
    # at start (countdown/ETA on quorum queues), and a worker declares only the queues it
    # consumes; the first worker up would find the others' exchanges missing. Declaring
    # all of them first (idempotent) makes the binding succeed on any start order.
    if not context().settings.broker_is_amqp:
        return
    try:
        with app.connection_for_write() as conn:
            for queue in app.amqp.queues.values():
                queue(conn.default_channel).declare()
    except Exception:  # the consumer declares its own queues (and retries the broker) anyway
        log.warning("could not declare the stage queues", exc_info=True)


@worker_init.connect
def _warm_cpu_stage(sender=None, **_):
    # The CPU stages load the tokenizer in the main process before their prefork pool
    # forks, so no pool process pays the load on its first request (seconds on a small
    # machine) and a model without a usable tokenizer stops the worker at once.
    # They serve every model: each served model's tokenizer is loaded here once.
    if serves(_PRE, _POST):
        ctx = context()
        for m in ctx.served.models:
            try:
                ctx.model(m.name).tokenizer_owner.get()
                ctx.model(m.name).context_len  # noqa: B018 - reads config.json once
            except Exception as exc:  # a worker that cannot tokenize must not take traffic
                _cannot_warm(f"tokenizer for model {m.name} ({m.source})", exc)


_loading = threading.Event()  # set while _warm loads the engine
_loading_heart = None  # the loading worker's Celery heartbeat (it says worker-offline on a stop)


@worker_ready.connect
def _warm(sender=None, **_):
    # The inference worker loads its engine before taking traffic, so the first request
    # does not pay the load (and it answers pings only once the engine is up).
    if serves(_INF):
        global _loading_heart
        _loading_heart = getattr(sender, "heart", None)  # the sender is the worker's consumer
        s = context().settings
        log.info("loading engine %s for model %s (queue %s)", s.engine.value, context().own_model.name,
                 context().own_model.queue)
        _loading.set()
        try:
            context().inference()
        except Exception as exc:  # a worker without an engine must not take traffic
            _cannot_warm(f"engine {s.engine.value}", exc)
        finally:
            _loading.clear()
        log.info("engine ready")


@worker_init.connect
@worker_ready.connect
def _freeze_startup_heap(**_):
    # What start-up built (Celery and the tokenizer; torch and vLLM in the inference worker:
    # hundreds of thousands of objects) lives as long as the process. Frozen, a full
    # collection no longer walks it (0.2 s of CPU on a heap with torch, measured here), exit
    # skips its final sweep, and prefork children (forked after worker_init) do not write
    # to the pages they share with their parent. vLLM's engine core does the same.
    freeze_heap()


_beacon = None


@worker_ready.connect
def _announce_ready(sender=None, **_):
    # After _warm (connected first, so it runs first): the API's GET /health answers 200
    # once every stage has a ready worker (llmpipe/observability/readiness.py).
    global _beacon
    # An inference worker is ready for its model's queue (inference.<name> with several
    # models): /healthz names the model whose workers are all gone.
    stages = [context().own_model.queue if s == _INF else s for s in STAGES if serves(s)]
    node = getattr(sender, "hostname", None) or f"pid{os.getpid()}"
    _beacon = ReadinessBeacon(context().redis, stages, node).start()


@worker_shutdown.connect
def _withdraw_ready(**_):
    if _beacon is not None:
        _beacon.stop()


@worker_shutting_down.connect
def _leave_routing(**_):
    # As a warm shutdown begins: preprocess routes nothing more to this worker's own queue,
    # while the requests it holds finish (llmpipe/routing/).
    context().leave_routing()


@worker_shutting_down.connect
def _stop_while_loading(sig=None, **_):
    # Runs in Celery's signal handler, on the main thread, which may be in _warm's load: a
    # worker whose engine is still loading has nothing to wait for, and stops now instead
    # of after the load (the seconds of a tiny model, a compile's minutes). It exits here,
    # with the load's processes, rather than raise into the load (workers/load_stop.py).
    if _loading.is_set():
        log.warning("%s while the engine loads: stopping now, with no request held", sig)
        stop_loading_worker(_loading_heart)


@worker_shutdown.connect
@worker_process_shutdown.connect
def _shutdown(**_):
    context().shutdown_all()


# -- reliability (docs/reliability.md) ---------------------------------------------------
_watchdog = None


@worker_ready.connect
def _start_watchdog(sender=None, **_):
    # The deadline watchdog runs in the postprocess/collect workers' main process: it settles
    # jobs that nothing finished by their deadline (llmpipe/jobs/watchdog.py). Its own client, so
    # prefork children never share its connections.
    global _watchdog
    s = get_settings()
    if not serves(_POST, COLLECT) or s.watchdog_interval_s <= 0:
        return
    r = from_settings(s, socket_timeout=5, socket_connect_timeout=3, health_check_interval=30)
    dl = DeadLetters(r, ttl_s=s.deadletter_ttl_s, max_entries=s.deadletter_max_entries)
    _watchdog = WatchdogLoop(Watchdog(r, JobStore(r, s.result_ttl_s), grace_s=s.watchdog_grace_s, deadletters=dl),
                             s.watchdog_interval_s).start()


@worker_shutdown.connect
def _stop_watchdog(**_):
    if _watchdog is not None:
        _watchdog.stop()


@task_failure.connect
def _dead_letter(sender=None, task_id=None, exception=None, args=None, kwargs=None, **_):
    """A task raised an unexpected exception: its chord fails, so its job ends ``failed``
    (the job record is what the API reads), and a dead letter is kept. Not when the broker
    refused the next stage: that message is requeued (llmpipe/broker/requeue.py)."""
    if requeued_on(exception):
        return
    name = getattr(sender, "name", None) or str(sender)
    context().task_failures.record(name, task_id, exception, args, kwargs)  # never raises


def _survive_broker_loss_with_unacked_messages() -> None:
    """Work around a kombu 5.7 bug that kills a worker when Redis goes away while it holds
    unacked messages (seen in tests/reliability/test_redis_restart.py): Celery's
    ``on_connection_error_after_connected`` collects the connection, which detaches the
    transport (``transport.client = None``), then closes it again; the second close asks the
    Redis channel to restore its unacked messages, whose ``_connparams`` dereferences the
    detached client: AttributeError, "Unrecoverable error", and the worker exits. A detached
    transport is a connection error instead: the close goes on, the consumer reconnects, and
    the unacked messages come back by the visibility timeout as after any crash."""
    original = kombu_redis.Channel._connparams
    if getattr(original, "_llmpipe_patched", False):
        return

    def _connparams(self, asynchronous=False):
        if getattr(self.connection, "client", None) is None:
            raise redis.exceptions.ConnectionError("the broker connection was already released")
        return original(self, asynchronous=asynchronous)

    _connparams._llmpipe_patched = True
    kombu_redis.Channel._connparams = _connparams


_survive_broker_loss_with_unacked_messages()


# The one hook from outside the runtime (workers/hook.py); the tests' fault injection.
hook.install()
