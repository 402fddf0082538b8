"""The pool, concurrency and prefetch each queue needs, for any Celery worker of this app.

``llmpipe worker KIND`` passes them on its command line (workers/launch.py). A plain
``celery -A tasks worker [-Q ...]`` gets them here, from the queues it consumes. Celery
sends ``worker_init`` after it has selected the queues and before it builds the pool or
connects a consumer: what is set here is what the worker runs with, and a worker that
refuses here has taken no message.

* A worker that consumes ``inference`` runs on threads: one process owns the engine and
  its batcher, and vLLM cannot start in a daemonic prefork child ("daemonic processes are
  not allowed to have children"), so every job would fail. What the command line leaves
  out becomes what ``llmpipe worker inference`` runs: ``-P threads``, its ``-c`` and
  ``--prefetch-multiplier 1``. An explicit other pool (``-P prefork``, ``solo``, ...) is a
  choice that cannot serve: the worker prints one ``llmpipe:`` line with the command to
  use and exits with EXIT_WRONG_POOL.
* A worker without ``-Q`` consumes every queue: a development set-up, one process with
  the engine in it, on threads as above.
* The CPU stages keep Celery's defaults (prefork, one process per CPU, the app's prefetch 1).
* The node name, unless given with ``-n``, is the kind (``inference@host``), so plain
  workers on one host do not all answer to ``celery@host`` in Flower and ``inspect``.
* What a worker warms (tokenizer, engine) and whether it runs the deadline watchdog
  follow the stages it serves: LLMPIPE_WORKER_KIND when set, else its queues (``serves``).
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from dataclasses import dataclass

import click
from celery.concurrency import ALIASES as POOL_ALIASES
from celery.signals import celeryd_after_setup, worker_init
from celery.utils.nodenames import gethostname
from click.core import ParameterSource

from llmpipe.models.served import INFERENCE_PREFIX, is_inference_queue, stage_of
from llmpipe.settings import Settings, get_settings
from llmpipe.stages import STAGE_QUEUES, ExitCode, Stage, inference_queue, worker_queue
from workers.context import WORKER_CAPACITY_ENV, WORKER_MODEL_ENV, WORKER_NODE_ENV, WORKER_QUEUE_ENV
from workers.launch import KIND_ENV, KINDS

log = logging.getLogger("llmpipe.worker")

STAGES = frozenset(STAGE_QUEUES)
ALL = "all"  # the kind of a worker that serves every stage (no -Q)
EXIT_WRONG_POOL = ExitCode.WRONG_POOL
_INFERENCE = Stage.INFERENCE.value


@dataclass(frozen=True)
class Started:
    """What a worker was started with; ``*_given``: on its command line, not a default."""

    queues: tuple[str, ...]
    pool: str
    pool_given: bool
    concurrency: int
    concurrency_given: bool
    prefetch_given: bool
    name_given: bool
    kind_env: str | None = None


@dataclass(frozen=True)
class Plan:
    """What the worker runs with; None keeps what it has. ``refusal`` set: it must not start."""

    kind: str | None
    stages: frozenset[str]
    pool: str | None = None
    concurrency: int | None = None
    prefetch: int | None = None
    node: str | None = None
    refusal: str | None = None
    model: str | None = None  # the served model whose inference queue it consumes


def kind_of(stages: frozenset[str]) -> str | None:
    """The kind whose queues these are (postprocess alone is postprocess), ALL for every stage."""
    for name, k in KINDS.items():
        if frozenset(k.queues) == stages:
            return name
    if stages == {Stage.POSTPROCESS}:
        return Stage.POSTPROCESS.value
    return ALL if stages == STAGES else None


def stages_of(kind: str | None, queues: tuple[str, ...] = ()) -> frozenset[str]:
    if kind in KINDS:
        return frozenset(KINDS[kind].queues)
    if kind == ALL:
        return STAGES
    return frozenset(queues) & STAGES


def plan(started: Started, s: Settings, hostname: str) -> Plan:
    # inference.<model> is the inference stage of one model (llmpipe/models/served.py).
    consumed = frozenset(stage_of(q) for q in started.queues) & STAGES
    kind = started.kind_env if started.kind_env else kind_of(consumed)
    stages = stages_of(kind, tuple(stage_of(q) for q in started.queues))
    model = None
    if _INFERENCE in consumed | stages:
        mine = sorted({q for q in started.queues if is_inference_queue(q)} & set(s.served.inference_queues))
        if len(mine) > 1:  # one process holds one engine
            return Plan(kind, stages, refusal=(
                f"llmpipe: a worker serves one model's inference queue, not {len(mine)} ({', '.join(mine)}); "
                f"start one per model, e.g.: celery -A tasks worker -Q {mine[0]} (or: llmpipe worker inference "
                f"--model {s.served.for_queue(mine[0]).name})"))
        model = s.served.for_queue(mine[0]).name if mine else None
    base = inference_queue(model) if kind == _INFERENCE and model and s.served.several else kind
    node = f"{base}@{hostname}" if kind in KINDS and not started.name_given else None
    if _INFERENCE not in consumed | stages:
        return Plan(kind, stages, node=node)
    inference = KINDS[_INFERENCE]
    n = started.concurrency if started.concurrency_given else inference.concurrency(s)
    if started.pool != inference.pool and started.pool_given:
        return Plan(kind, stages, refusal=_refusal(started, n), model=model)
    return Plan(kind, stages, pool=inference.pool, concurrency=None if started.concurrency_given else n,
                prefetch=None if started.prefetch_given else inference.prefetch, node=node, model=model)


def _refusal(started: Started, n: int) -> str:
    inference = KINDS[_INFERENCE]
    queues = [] if STAGES <= set(started.queues) else ["-Q", ",".join(started.queues)]
    cmd = shlex.join(["celery", "-A", "tasks", "worker", *queues, "-P", inference.pool, "-c", str(n),
                      "--prefetch-multiplier", str(inference.prefetch)])
    alt = (" (or: llmpipe worker inference)" if set(started.queues) == {_INFERENCE} else
           f" (or: llmpipe worker inference --model {started.queues[0].removeprefix(INFERENCE_PREFIX)})"
           if len(started.queues) == 1 and is_inference_queue(started.queues[0]) else "")
    why = _WHY.get(started.pool, "the engine and its batcher live in one process, fed by one thread per request")
    return (f"llmpipe: the inference queue needs -P {inference.pool}, not -P {started.pool} ({why}); "
            f"start this worker with: {cmd}{alt}")


_WHY = {
    "prefork": "vLLM cannot start its engine in a daemonic prefork child, so every job would fail",
    "processes": "vLLM cannot start its engine in a daemonic prefork child, so every job would fail",
    "solo": "solo runs one task at a time, so the batcher would never batch",
    "gevent": "the engine's threads and sockets do not run under green-thread monkey patching",
    "eventlet": "the engine's threads and sockets do not run under green-thread monkey patching",
}


# -- the worker this process runs -------------------------------------------------------
_stages: frozenset[str] | None = None


def serves(*stages: str) -> bool:
    """Whether this worker serves any of ``stages`` (set at worker_init; before that, or
    outside a worker, from LLMPIPE_WORKER_KIND)."""
    mine = _stages if _stages is not None else stages_of(os.environ.get(KIND_ENV))
    return bool(mine & set(stages))


def pool_name(pool_cls) -> str:
    """Celery's alias for a pool class or name (``prefork``, ``threads``, ...)."""
    if isinstance(pool_cls, str):
        return pool_cls
    target = f"{pool_cls.__module__}:{pool_cls.__qualname__}"
    return next((alias for alias, path in POOL_ALIASES.items() if path == target), target)


def _given(name: str) -> bool | None:
    """Whether the ``celery worker`` option ``name`` came from the command line (or its
    CELERY_WORKER_* variable); None outside Celery's command line."""
    ctx = click.get_current_context(silent=True)
    if ctx is None or name not in ctx.params:
        return None
    return ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT)


def started_from(worker) -> Started:
    pool = pool_name(worker.pool_cls)
    pool_given = _given("pool")
    if pool_given is None:  # built in code (app.Worker(...)): only Celery's default counts as unchosen
        pool_given = pool not in ("prefork", "processes")
    return Started(
        queues=tuple(worker.app.amqp.queues.consume_from), pool=pool, pool_given=pool_given,
        concurrency=worker.concurrency, concurrency_given=bool(_given("concurrency")),
        prefetch_given=bool(_given("prefetch_multiplier")), name_given=_given("hostname") is not False,
        kind_env=os.environ.get(KIND_ENV) or None,
    )


@worker_init.connect
def _apply(sender=None, **_):
    global _stages
    started = started_from(sender)
    p = plan(started, get_settings(), gethostname())
    if p.refusal is not None:
        # Before the pool and the consumer exist: no message was taken. The real stderr,
        # unformatted, so that a supervisor (llmpipe up) shows this line as the reason.
        print(p.refusal, file=sys.__stderr__, flush=True)
        raise SystemExit(EXIT_WRONG_POOL)
    _stages = p.stages
    if p.model is not None:
        os.environ[WORKER_MODEL_ENV] = p.model  # the model its engine loads (workers/context.py)
    if p.kind and not started.kind_env:
        os.environ[KIND_ENV] = p.kind  # for code that reads the kind from the environment
    changes = []
    if p.pool is not None and p.pool != started.pool:
        sender.pool_cls = p.pool
        changes.append(f"-P {p.pool}")
    if p.concurrency is not None and p.concurrency != sender.concurrency:
        sender.concurrency = p.concurrency
        changes.append(f"-c {p.concurrency}")
    if p.prefetch is not None and p.prefetch != sender.prefetch_multiplier:
        sender.prefetch_multiplier = p.prefetch
        changes.append(f"--prefetch-multiplier {p.prefetch}")
    if p.node is not None and p.node != sender.hostname:
        sender.hostname = p.node
        changes.append(f"-n {p.node}")
    if _INFERENCE in p.stages:
        os.environ[WORKER_NODE_ENV] = sender.hostname  # the worker label of its engine metrics
    if _INFERENCE in p.stages and get_settings().prefix_routing:
        own = _consume_own_queue(sender.app, get_settings().served.get(p.model).queue, sender.hostname)
        os.environ[WORKER_QUEUE_ENV] = own  # its routing membership (workers/context.py)
        os.environ[WORKER_CAPACITY_ENV] = str(sender.concurrency * max(1, sender.prefetch_multiplier or 1))
        changes.append(f"also consumes its own queue {own} (prefix-aware routing)")
    if changes:
        _changes[:] = [f"{p.kind or 'this'} worker (queues {','.join(started.queues)}) runs with {' '.join(changes)}"]


_changes: list[str] = []


def _consume_own_queue(app, shared: str, node: str) -> str:
    """Consume ``shared``'s queue for this node too, before the others: preprocess sends
    there the requests whose prefix this worker's engine caches (llmpipe/routing/)."""
    own = worker_queue(shared, node)
    queues = app.amqp.queues
    q = queues[own]  # declared as llmpipe/broker/worker_queues.py says
    if queues._consume_from is not None:
        queues._consume_from = {own: q, **queues._consume_from}
    else:
        queues._default_consume_from = {own: q, **queues._default_consume_from}
    return own


@celeryd_after_setup.connect
def _say_changes(**_):
    # worker_init comes before Celery sets up logging; the banner shows the result too.
    for line in _changes:
        log.info("%s", line)
