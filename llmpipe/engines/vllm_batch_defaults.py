"""vLLM's own ``max_num_seqs`` where llmpipe leaves it unset: how many sequences vLLM runs at
once, which the inference worker sizes its threads by (workers/launch.py) before the engine
starts.

vLLM picks it by device for ``vllm serve``'s usage context, which llmpipe's engine uses
(vllm/engine/arg_utils.py, ``get_batch_defaults``, vLLM 0.32): 128 per CPU rank; 1024 on a
GPU of 160 GiB or more, or of 70 GiB or more that is not an A100; 256 on any other GPU. A
worker that holds fewer requests than that caps vLLM's running set below its own: sized by
the dispatch batch, it held vLLM to 64 of its 128 on a CPU (docs/benchmarks.md, "The Batch
API").
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from functools import lru_cache

from llmpipe.engines.platform import Platform
from llmpipe.settings import Settings

GIB = 1 << 30
CPU_MAX_NUM_SEQS = 128  # per rank (tensor x pipeline parallel)
GPU_MAX_NUM_SEQS = 256
LARGE_GPU_MAX_NUM_SEQS = 1024


@dataclass(frozen=True)
class Device:
    """What vLLM sizes its batch defaults by: the platform, and a GPU's name and memory."""

    platform: Platform
    name: str = ""
    memory_bytes: int = 0


def vllm_max_num_seqs(device: Device, world_size: int = 1) -> int:
    """vLLM's default ``max_num_seqs`` on ``device`` for an engine of ``world_size`` ranks."""
    if device.platform is Platform.CPU:
        return CPU_MAX_NUM_SEQS * world_size
    large = device.memory_bytes >= 160 * GIB or (device.memory_bytes >= 70 * GIB and "a100" not in device.name.lower())
    return LARGE_GPU_MAX_NUM_SEQS if large else GPU_MAX_NUM_SEQS


def world_size(s: Settings) -> int:
    """The ranks of one engine as vLLM counts them for its batch defaults: tensor x pipeline parallel."""
    return int(s.engine_args.get("tensor_parallel_size") or 1) * int(s.engine_args.get("pipeline_parallel_size") or 1)


def parse_nvidia_smi(out: str) -> tuple[str, int] | None:
    """(name, memory in bytes) from ``nvidia-smi --query-gpu=name,memory.total
    --format=csv,noheader,nounits``'s first line (memory in MiB); None when unreadable."""
    first = out.strip().splitlines()[0] if out.strip() else ""
    name, _, mib = first.rpartition(",")
    try:
        return name.strip(), int(float(mib)) * (1 << 20)
    except ValueError:
        return None


# ``nvidia-smi -L``: a GPU's line, then one line per MIG device on it, whose profile names
# its memory ("MIG 1g.10gb     Device  0: (UUID: MIG-...)").
_GPU_LINE = re.compile(r"^GPU \d+: (.+?) \(UUID: ")
_MIG_LINE = re.compile(r"^\s*MIG (\d+g\.(\d+)gb)\s+Device\s+\d+: \(UUID: (MIG-[^)\s]+)\)")


def parse_mig_listing(out: str, uuid: str) -> tuple[str, int] | None:
    """(name, memory in bytes) of the MIG device ``uuid`` in ``nvidia-smi -L``'s listing: its
    GPU's name and its profile, and the profile's memory (in GB, as NVIDIA names profiles:
    within a few percent of what vLLM reads, and no profile lies near its 70 or 160 GiB
    steps). None when the listing does not name it."""
    gpu = ""
    for line in out.splitlines():
        if m := _GPU_LINE.match(line):
            gpu = m.group(1)
        elif (m := _MIG_LINE.match(line)) and m.group(3) == uuid:
            return f"{gpu} MIG {m.group(1)}", int(m.group(2)) * 10**9
    return None


def _nvidia_smi(args: list[str]) -> str | None:
    """nvidia-smi's output, or None where it is missing or fails."""
    try:
        proc = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def first_gpu(env: dict[str, str] | None = None) -> tuple[str, int] | None:
    """The first visible GPU's name and memory, read by nvidia-smi (NVML), so that the process
    that sizes a worker holds no CUDA context (vLLM counts another process's memory against its
    own). A MIG device (``MIG-<uuid>`` in CUDA_VISIBLE_DEVICES) is read from the device
    listing: ``--query-gpu -i`` is for GPUs, and would answer nothing for it or its whole
    GPU, not the slice that vLLM runs on. None where nvidia-smi is missing or fails."""
    env = os.environ if env is None else env
    visible = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if "CUDA_VISIBLE_DEVICES" in env and not visible:  # set and empty: the CPU, as for torch
        return None
    if visible and visible[0].startswith("MIG-"):
        listing = _nvidia_smi(["-L"])
        return parse_mig_listing(listing, visible[0]) if listing is not None else None
    out = _nvidia_smi(["--query-gpu=name,memory.total", "--format=csv,noheader,nounits",
                       *(["-i", visible[0]] if visible else [])])
    return parse_nvidia_smi(out) if out is not None else None


@lru_cache(maxsize=1)
def this_device() -> Device:
    """This host's device: the first GPU nvidia-smi reads, else the CPU. Not torch's view
    (llmpipe/engines/platform.py), which would cost the command that sizes a worker a torch
    import; where the two differ (a CPU build of torch on a GPU host) the worker holds more
    requests than its engine runs, which costs only idle threads."""
    gpu = first_gpu()
    return Device(Platform.CUDA, *gpu) if gpu else Device(Platform.CPU)


def default_max_num_seqs(s: Settings, device: Device | None = None) -> int:
    """vLLM's ``max_num_seqs`` for ``s``'s engine on ``device`` (this host's when None)."""
    if device is None:
        device = this_device()
    return vllm_max_num_seqs(device, world_size(s))
