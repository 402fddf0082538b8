"""Which models this deployment serves, by what name, and on which inference queue.

Pure logic, no Celery: the API routes a request by its ``model`` with it, the workers pick
a tokenizer or an engine with it, and ``llmpipe up`` starts one inference worker per model.

A model is given as ``SOURCE`` or ``NAME=SOURCE`` (settings ``model`` / ``models``, ``llmpipe
up --model``). SOURCE is what ``resolve_model`` takes ("tiny", "smollm2", a folder, a hub
id); NAME is what requests say in ``model`` and what the queue is named after; without one
it is SOURCE's last path segment ("smollm2", "tiny", "SmolLM2-135M-Instruct").

Queues: one model keeps the one ``inference`` queue, so a single-model deployment (and a
plain ``celery -A tasks worker -Q inference``) works as it always did; with several models
each has its own ``inference.<name>``, served by its own inference workers and scaled on its
own (one KEDA ScaledObject per queue).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from llmpipe.errors import ModelNotFoundError
from llmpipe.stages import COLLECT, Stage, shared_queue
from llmpipe.stages import inference_queue as _queue_of

INFERENCE = Stage.INFERENCE.value
INFERENCE_PREFIX = INFERENCE + "."
# Queue-, metric-label- and file-name-safe; what Kubernetes names need is the manifests' concern.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class ModelSpecError(ValueError):
    """A model setting that cannot name a served model."""


@dataclass(frozen=True)
class ServedModel:
    name: str  # the request's ``model``, the queue suffix, the metrics label
    source: str  # what llmpipe.models.registry.resolve_model prepares
    queue: str  # its inference queue
    # What responses and /v1/models call it: the name, except for one model given without a
    # name, which keeps the setting as given (as vLLM's served model name defaults to --model).
    id: str = ""

    def __post_init__(self):
        if not self.id:
            object.__setattr__(self, "id", self.name)

    def answers_to(self, requested: str) -> bool:
        """Whether a request naming ``requested`` means this model: its name, its source,
        or the last path segment of either (a client may send the hub id or the folder)."""
        want = requested.strip().rstrip("/")
        last = want.split("/")[-1]
        return want in (self.name, self.source.rstrip("/")) or last in (self.name, _last(self.source))


def _last(source: str) -> str:
    return source.strip().rstrip("/").split("/")[-1]


def parse_spec(spec: str) -> tuple[str, str]:
    """``NAME=SOURCE`` or ``SOURCE`` -> (name, source)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ModelSpecError("a model is empty")
    spec = spec.strip()
    name, sep, source = spec.partition("=")
    if not sep:
        name, source = _last(spec), spec
    name, source = name.strip(), source.strip()
    if not source:
        raise ModelSpecError(f"model {spec!r} names no source (NAME=SOURCE)")
    if not _NAME.match(name):
        raise ModelSpecError(f"model name {name!r} (from {spec!r}) must be letters, digits, '.', '_' or '-' "
                             f"(give one as NAME=SOURCE)")
    return name, source


def inference_queue(name: str, several: bool) -> str:
    """The queue of model ``name``: its own only when several models are served."""
    return _queue_of(name if several else None)


def is_inference_queue(queue: str) -> bool:
    """A model's inference queue, or one of its workers' own (``inference~node``)."""
    queue = shared_queue(queue)
    return queue == INFERENCE or queue.startswith(INFERENCE_PREFIX)


def stage_of(queue: str) -> str:
    """``inference.tiny`` -> ``inference``; every other queue is its own stage."""
    return INFERENCE if is_inference_queue(queue) else queue


def model_of_queue(queue: str) -> str | None:
    """``inference.tiny`` (or a worker's own ``inference.tiny~node``) -> ``tiny``; None for any
    other queue (``inference`` included)."""
    queue = shared_queue(queue)
    return queue.removeprefix(INFERENCE_PREFIX) if queue.startswith(INFERENCE_PREFIX) else None


@dataclass(frozen=True)
class ModelSet:
    models: tuple[ServedModel, ...]

    @classmethod
    def from_specs(cls, specs: Sequence[str]) -> ModelSet:
        parsed = [parse_spec(s) for s in specs]
        named = ["=" in s for s in specs]
        if not parsed:
            raise ModelSpecError("no model to serve")
        names = [n for n, _ in parsed]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ModelSpecError(f"model name {dup!r} is given twice (name them apart with NAME=SOURCE)")
        several = len(parsed) > 1
        return cls(tuple(ServedModel(n, src, inference_queue(n, several), id=n if several or given else src)
                         for (n, src), given in zip(parsed, named, strict=True)))

    @property
    def default(self) -> ServedModel:
        """A request without ``model`` gets the first one (vLLM's server has one model; a
        client that never names it keeps working)."""
        return self.models[0]

    @property
    def several(self) -> bool:
        return len(self.models) > 1

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.models]

    @property
    def inference_queues(self) -> tuple[str, ...]:
        return tuple(m.queue for m in self.models)

    def stage_queues(self) -> tuple[str, ...]:
        """Every queue a job passes through, in pipeline order (admission, depth gauges)."""
        return (Stage.PREPROCESS.value, *self.inference_queues, Stage.POSTPROCESS.value)

    def readiness_stages(self) -> tuple[str, ...]:
        """What a job needs a live worker for: each stage, each model's inference queue on its own."""
        return (Stage.PREPROCESS.value, *self.inference_queues, Stage.POSTPROCESS.value, COLLECT)

    def get(self, requested: str | None) -> ServedModel:
        """The model a request names (None: the default); ModelNotFoundError (404) otherwise."""
        if requested is None or not requested.strip():
            return self.default
        for m in self.models:  # an exact name first: "tiny" is never another model's folder
            if requested.strip() in (m.name, m.id):
                return m
        for m in self.models:
            if m.answers_to(requested):
                return m
        raise ModelNotFoundError(
            f"The model `{requested}` does not exist; this server serves {', '.join(repr(n) for n in self.names)}",
            param="model")

    def for_queue(self, queue: str) -> ServedModel:
        """The model an inference queue serves (``inference``: the default one), or a worker's own queue."""
        queue = shared_queue(queue)
        for m in self.models:
            if m.queue == queue:
                return m
        name = model_of_queue(queue)
        if name is not None:
            return self.get(name)
        if queue == INFERENCE:
            return self.default
        raise ModelNotFoundError(f"queue {queue!r} is no model's inference queue", param="model")


def model_set(model: str, models: Iterable[str] = ()) -> ModelSet:
    """The served set from the settings: ``models`` when given, else the one ``model``."""
    models = list(models)
    return ModelSet.from_specs(models or [model])
