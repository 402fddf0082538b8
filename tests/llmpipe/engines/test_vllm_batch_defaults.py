"""vLLM's own max_num_seqs by device (llmpipe/engines/vllm_batch_defaults.py), which the
inference worker's threads are sized by: checked against vLLM's own ``get_batch_defaults``
with its device probe given each device in turn (no GPU here), and the nvidia-smi probe
against a stand-in program on PATH."""

from __future__ import annotations

import stat

import pytest

from llmpipe.engines.platform import Platform
from llmpipe.engines.vllm_batch_defaults import (
    GIB,
    Device,
    default_max_num_seqs,
    first_gpu,
    parse_mig_listing,
    parse_nvidia_smi,
    vllm_max_num_seqs,
    world_size,
)
from llmpipe.settings import EngineKind, Settings
from workers.launch import KINDS, engine_running

H100 = Device(Platform.CUDA, "NVIDIA H100 80GB HBM3", 81559 << 20)
H200 = Device(Platform.CUDA, "NVIDIA H200", 143771 << 20)
A100 = Device(Platform.CUDA, "NVIDIA A100-SXM4-80GB", 81920 << 20)
B200 = Device(Platform.CUDA, "NVIDIA B200", 183359 << 20)
L4 = Device(Platform.CUDA, "NVIDIA L4", 23034 << 20)
UNREAD = Device(Platform.CUDA)
CPU = Device(Platform.CPU)


@pytest.mark.parametrize(("device", "ranks", "seqs"), [
    (CPU, 1, 128), (CPU, 2, 256), (H100, 1, 1024), (H200, 2, 1024), (B200, 1, 1024), (A100, 1, 256), (L4, 1, 256),
    (UNREAD, 1, 256),
])
def test_the_running_set_is_vllms_own_for_the_device(device, ranks, seqs):
    assert vllm_max_num_seqs(device, ranks) == seqs


def _vllms_pick(device: Device, ranks: int, monkeypatch) -> int:
    """vLLM's own max_num_seqs for ``vllm serve`` with its device probe answering ``device``."""
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.usage.usage_lib import UsageContext

    on_cpu = device.platform is Platform.CPU
    monkeypatch.setattr(current_platform, "is_cpu", lambda: on_cpu)
    monkeypatch.setattr(current_platform, "is_tpu", lambda: False)
    monkeypatch.setattr(current_platform, "get_device_total_memory", lambda device_id=0: device.memory_bytes)
    monkeypatch.setattr(current_platform, "get_device_name", lambda device_id=0: device.name)
    _, seqs = EngineArgs.get_batch_defaults(ranks)
    return seqs[UsageContext.OPENAI_API_SERVER]


@pytest.mark.parametrize("device", [CPU, H100, H200, A100, B200, L4])
@pytest.mark.parametrize("ranks", [1, 2])
def test_it_is_what_vllm_picks_for_vllm_serve(device, ranks, monkeypatch):
    assert vllm_max_num_seqs(device, ranks) == _vllms_pick(device, ranks, monkeypatch)


def test_the_worker_holds_twice_the_running_set_of_its_device_unless_max_num_seqs_is_set():
    assert engine_running(Settings(), H100) == 1024 and engine_running(Settings(), A100) == 256
    assert engine_running(Settings(max_num_seqs=64), H100) == 64
    assert engine_running(Settings(max_batch_size=512), A100) == 512  # never less than a dispatch batch
    assert engine_running(Settings(engine=EngineKind.SIMULATED), H100) == 32  # another engine: its batch
    tp2 = Settings(engine_args={"tensor_parallel_size": 2})
    assert world_size(tp2) == 2 and default_max_num_seqs(tp2, CPU) == 256
    assert KINDS["inference"].concurrency(Settings()) == 2 * engine_running(Settings())  # this host's


def test_nvidia_smis_line_gives_the_name_and_memory():
    assert parse_nvidia_smi("NVIDIA H100 80GB HBM3, 81559\nNVIDIA H100 80GB HBM3, 81559\n") == (
        "NVIDIA H100 80GB HBM3", 81559 << 20)
    assert parse_nvidia_smi("") is None and parse_nvidia_smi("No devices were found") is None
    assert (81559 << 20) >= 70 * GIB > (23034 << 20)


def _stand_in(tmp_path, monkeypatch, body: str) -> None:
    exe = tmp_path / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\n{body}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")


def test_the_first_visible_gpu_is_read_without_torch(tmp_path, monkeypatch):
    # The stand-in names the GPU it was asked for (-i), as the real one would answer for it.
    _stand_in(tmp_path, monkeypatch, 'if [ "$3" = "-i" ]; then echo "GPU $4, 143771"; else echo "GPU 0, 143771"; fi')
    assert first_gpu({}) == ("GPU 0", 143771 << 20)
    assert first_gpu({"CUDA_VISIBLE_DEVICES": "2,3"}) == ("GPU 2", 143771 << 20)
    assert first_gpu({"CUDA_VISIBLE_DEVICES": ""}) is None  # set and empty: the CPU, as for torch


# `nvidia-smi -L` on a host with MIG devices (the format NVIDIA's MIG user guide shows).
MIG_LISTING = """\
GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-950792bf-a01c-3f1a-e122-3473e67f54b2)
  MIG 1g.10gb     Device  0: (UUID: MIG-b3061c09-2a4c-5026-a575-79f86a5bb12c)
  MIG 3g.40gb     Device  1: (UUID: MIG-27b1a30b-e164-5ba8-9904-9d949f65d8e4)
GPU 1: NVIDIA A100-SXM4-80GB (UUID: GPU-9c73eb7b-8d6d-6c0e-dc13-97873e2ede40)
  MIG 7g.80gb     Device  0: (UUID: MIG-a686709d-6dc2-542a-8851-0d2508448c10)
GPU 2: NVIDIA H100 80GB HBM3 (UUID: GPU-c92e2d5d-4a69-f1cd-4df0-305f8606705a)
  MIG 7g.80gb     Device  0: (UUID: MIG-d5a46a2e-1d77-575d-99e3-1f96c8555a2e)
"""


def test_a_mig_device_is_its_gpus_name_and_its_profiles_memory():
    assert parse_mig_listing(MIG_LISTING, "MIG-27b1a30b-e164-5ba8-9904-9d949f65d8e4") == (
        "NVIDIA H100 80GB HBM3 MIG 3g.40gb", 40 * 10**9)
    assert parse_mig_listing(MIG_LISTING, "MIG-a686709d-6dc2-542a-8851-0d2508448c10") == (
        "NVIDIA A100-SXM4-80GB MIG 7g.80gb", 80 * 10**9)
    assert parse_mig_listing(MIG_LISTING, "MIG-00000000-0000-0000-0000-000000000000") is None
    assert parse_mig_listing("", "MIG-b3061c09-2a4c-5026-a575-79f86a5bb12c") is None


# Drivers before R470 name a MIG device by its GPU's UUID and its instance ids, in the
# listing and in CUDA_VISIBLE_DEVICES alike (NVIDIA's MIG user guide of that release).
LEGACY_MIG_LISTING = """\
GPU 0: A100-SXM4-40GB (UUID: GPU-e91edf3b-b297-37c1-a2a7-7601c3238fa2)
  MIG 3g.20gb Device 0: (UUID: MIG-GPU-e91edf3b-b297-37c1-a2a7-7601c3238fa2/1/0)
  MIG 1g.5gb Device 1: (UUID: MIG-GPU-e91edf3b-b297-37c1-a2a7-7601c3238fa2/7/0)
"""


def test_a_mig_device_named_as_drivers_before_r470_name_it_is_read_too():
    assert parse_mig_listing(LEGACY_MIG_LISTING, "MIG-GPU-e91edf3b-b297-37c1-a2a7-7601c3238fa2/7/0") == (
        "A100-SXM4-40GB MIG 1g.5gb", 5 * 10**9)
    assert parse_mig_listing(LEGACY_MIG_LISTING, "MIG-GPU-e91edf3b-b297-37c1-a2a7-7601c3238fa2/2/0") is None


# Each MIG device with about what CUDA reports of it (torch's name and memory, which vLLM
# reads): a little under its profile's GB, on the same side of each of vLLM's steps.
@pytest.mark.parametrize(("uuid", "cuda_name", "cuda_gib"), [
    ("MIG-b3061c09-2a4c-5026-a575-79f86a5bb12c", "NVIDIA H100 80GB HBM3 MIG 1g.10gb", 9.75),
    ("MIG-27b1a30b-e164-5ba8-9904-9d949f65d8e4", "NVIDIA H100 80GB HBM3 MIG 3g.40gb", 39.25),
    ("MIG-a686709d-6dc2-542a-8851-0d2508448c10", "NVIDIA A100-SXM4-80GB MIG 7g.80gb", 79.25),
    ("MIG-d5a46a2e-1d77-575d-99e3-1f96c8555a2e", "NVIDIA H100 80GB HBM3 MIG 7g.80gb", 79.25),
])
def test_a_mig_device_gets_what_vllm_picks_for_it(uuid, cuda_name, cuda_gib, monkeypatch):
    read = Device(Platform.CUDA, *parse_mig_listing(MIG_LISTING, uuid))
    seen_by_vllm = Device(Platform.CUDA, cuda_name, int(cuda_gib * GIB))
    assert vllm_max_num_seqs(read) == _vllms_pick(seen_by_vllm, 1, monkeypatch)


def test_a_visible_mig_device_is_read_from_the_listing(tmp_path, monkeypatch):
    # The stand-in answers -L alone: a query for one device by a MIG UUID is never made.
    listing = tmp_path / "listing"
    listing.write_text(MIG_LISTING)
    _stand_in(tmp_path, monkeypatch, f'if [ "$1" = "-L" ]; then cat {listing}; else exit 6; fi')
    assert first_gpu({"CUDA_VISIBLE_DEVICES": "MIG-d5a46a2e-1d77-575d-99e3-1f96c8555a2e"}) == (
        "NVIDIA H100 80GB HBM3 MIG 7g.80gb", 80 * 10**9)
    assert first_gpu({"CUDA_VISIBLE_DEVICES": "MIG-00000000-0000-0000-0000-000000000000"}) is None


def test_no_gpu_where_nvidia_smi_is_missing_or_fails(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert first_gpu({}) is None
    _stand_in(tmp_path, monkeypatch, 'echo "NVIDIA-SMI has failed"; exit 9')
    assert first_gpu({}) is None
