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


@pytest.mark.parametrize("device", [CPU, H100, H200, A100, B200, L4])
@pytest.mark.parametrize("ranks", [1, 2])
def test_it_is_what_vllm_picks_for_vllm_serve(device, ranks, monkeypatch):
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
    assert vllm_max_num_seqs(device, ranks) == seqs[UsageContext.OPENAI_API_SERVER]


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


def test_no_gpu_where_nvidia_smi_is_missing_or_fails(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert first_gpu({}) is None
    _stand_in(tmp_path, monkeypatch, 'echo "NVIDIA-SMI has failed"; exit 9')
    assert first_gpu({}) is None
