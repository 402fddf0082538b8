"""Which GPUs each inference worker of ``llmpipe up`` gets.

With one worker per model the workers share what they see, as before (several models on
one GPU split its memory, llmpipe/engines/platform.py). Once a model runs several workers
(``inference_workers``), every inference worker gets GPUs of its own, in order, as
``CUDA_VISIBLE_DEVICES``: ``tensor_parallel_size x pipeline_parallel_size x
data_parallel_size`` of them each, and all of them must fit the GPUs this process sees, or
nothing starts. On the CPU the workers share the cores.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from llmpipe.engines.platform import Platform, detect_platform
from llmpipe.settings import Settings

_PARALLEL = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")


class DeviceError(ValueError):
    """The inference workers asked for do not fit the GPUs there are."""


def gpus_per_worker(s: Settings) -> int:
    """The GPUs one engine spans: the product of its parallel sizes (engine arguments)."""
    n = 1
    for name in _PARALLEL:
        n *= int(s.engine_args.get(name) or 1)
    return n


def visible_gpus(env: Mapping[str, str] | None = None) -> list[str]:
    """The GPUs this process may use, named as CUDA_VISIBLE_DEVICES names them; none on the CPU."""
    env = os.environ if env is None else env
    if detect_platform() is not Platform.CUDA:
        return []
    given = env.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [d.strip() for d in given.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def own_gpus(s: Settings) -> bool:
    """Whether each inference worker gets GPUs of its own: once any model runs several."""
    return any(s.workers_of(m.name) > 1 for m in s.served.models)


def assign(s: Settings, workers: Sequence[str], gpus: Sequence[str]) -> dict[str, str]:
    """Inference worker -> its CUDA_VISIBLE_DEVICES; {} when they share (CPU, or one worker
    per model). Raises DeviceError when they do not fit."""
    if not gpus or not own_gpus(s):
        return {}
    per = gpus_per_worker(s)
    need = len(workers) * per
    if need > len(gpus):
        raise DeviceError(
            f"{len(workers)} inference workers x {per} GPU{'s' if per > 1 else ''} each (tensor_parallel_size x "
            f"pipeline_parallel_size x data_parallel_size) need {need} GPUs, and {len(gpus)} "
            f"{'is' if len(gpus) == 1 else 'are'} visible ({','.join(gpus)}): run fewer workers "
            f"(--inference-workers) or make more GPUs visible (CUDA_VISIBLE_DEVICES)")
    return {w: ",".join(gpus[i * per:(i + 1) * per]) for i, w in enumerate(workers)}
