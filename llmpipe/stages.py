"""The pipeline's stages: their queues and task names, the worker kinds that serve them, and
the exit codes that workers and ``llmpipe up`` agree on. This module owns these names;
everything else imports them.

A request goes preprocess -> inference -> postprocess; a job of several prompts ends in the
chord callback, collect. With several served models each model has its own inference queue,
``inference.<name>`` (llmpipe/models/served.py); with one model it is ``inference``.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum

# Every task is named llmpipe.<what it does>.
TASK_PREFIX = "llmpipe."


class Stage(StrEnum):
    """A stage a request's message passes through, in order, named as its queue and worker
    kind (the stage messages and their timings name these)."""

    PREPROCESS = "preprocess"
    INFERENCE = "inference"
    POSTPROCESS = "postprocess"

    @property
    def task(self) -> str:
        """The Celery task name (the API sends tasks by name, never by import)."""
        return f"{TASK_PREFIX}{self.value}"


# The job's last hop, after every request of a job of several prompts: the chord callback.
COLLECT = "collect"
COLLECT_TASK = f"{TASK_PREFIX}{COLLECT}"
# ``POST /tokenize`` runs on the preprocess queue: the stage that tokenizes answers.
TOKENIZE_TASK = f"{TASK_PREFIX}tokenize"

# Every stage queue, in pipeline order; with several models the inference queue is per model.
STAGE_QUEUES = (Stage.PREPROCESS.value, Stage.INFERENCE.value, Stage.POSTPROCESS.value, COLLECT)
# The stages that run on the CPU pools; their pool is the cpu_pool setting.
CPU_STAGES = (Stage.PREPROCESS, Stage.POSTPROCESS)


def task_stage(task_name: str) -> str:
    """What a task's name says it does: ``llmpipe.inference`` -> ``inference`` (dead letters name it)."""
    return task_name.removeprefix(TASK_PREFIX)


def inference_queue(model: str | None) -> str:
    """The inference queue of a served model: ``inference`` for the only model (None),
    ``inference.<name>`` when several are served."""
    return Stage.INFERENCE.value if model is None else f"{Stage.INFERENCE.value}.{model}"


# Each inference worker also consumes a queue of its own, ``<model's queue>~<worker node>``
# (``inference~inference-2-8000@llmpipe``), where preprocess sends the requests whose prompt
# prefix that worker has cached (llmpipe/routing/). Neither a model name nor a Celery queue
# or node name holds "~" ("@" is in every node name, and so in Celery's pidbox queues), so
# the first one splits a worker queue back into the model's (shared) queue and the node.
WORKER_QUEUE_SEP = "~"


def worker_queue(shared: str, node: str) -> str:
    """The queue of its own that the inference worker ``node`` consumes besides ``shared``."""
    return f"{shared}{WORKER_QUEUE_SEP}{node}"


def is_worker_queue(queue: str) -> bool:
    return WORKER_QUEUE_SEP in queue


def shared_queue(queue: str) -> str:
    """``inference~inference-2-8000@llmpipe`` -> ``inference``; any other queue is its own."""
    return queue.split(WORKER_QUEUE_SEP, 1)[0]


class ExitCode(IntEnum):
    """How a worker tells ``llmpipe up`` that it cannot start as configured. Before the
    stack first served, restarting such a child only repeats the error, so ``llmpipe up``
    stops with its reason instead."""

    CANNOT_WARM = 3  # the engine or tokenizer could not load (a bad model, engine argument)
    WRONG_POOL = 64  # sysexits' EX_USAGE: the command line cannot serve these queues


START_FAILURES = frozenset(ExitCode)
