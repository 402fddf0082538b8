"""Which engine arguments a worker gets: the platform's defaults, the settings, then the
vLLM engine arguments passed through (``--engine-arg`` / ``[engine_args]``).

The defaults are vLLM's own, as ``vllm serve MODEL`` picks them, on every platform:
dtype ``auto`` (the checkpoint's own; on an x86 or Arm CPU vLLM takes bfloat16 for a
float32 checkpoint), compiled (CUDA graphs on a GPU, torch.compile on the CPU), and vLLM's
own ``max_num_seqs``. On a CPU with bfloat16 instructions, float32 and eager mode served a
third of what ``vllm serve`` did (docs/benchmarks.md).

One default differs, with a measured reason: on a CPU without bfloat16 instructions
(x86's ``avx512_bf16`` or ``amx_bf16``, Arm's ``bf16``) vLLM still takes bfloat16, and torch
then runs a bfloat16 matmul ~90x slower than a float32 one (0.8 against 73 GFLOP/s on an
AVX2-only EPYC core); there the default dtype is float32 (docs/operations.md, "Engine
defaults"). Tests pin float32 and eager themselves, for exact token matches and fast
starts. ``engine_config`` takes the platform and the CPU's bfloat16 support as arguments,
so that the decision is tested on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from llmpipe.engines.vllm_args import (
    ALIAS_TYPES,
    SETTING_ALIASES,
    SKIP_TOKENIZER_INIT,
    EngineArgError,
    convert_engine_args,
)
from llmpipe.settings import EngineKind, Settings


class Platform(StrEnum):
    CUDA = "cuda"
    CPU = "cpu"


def detect_platform() -> Platform:
    """CUDA when torch sees a GPU (the test vLLM and the transformers engine make too),
    else the CPU. ``CUDA_VISIBLE_DEVICES=`` forces the CPU."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch comes with every real engine
        return Platform.CPU
    return Platform.CUDA if torch.cuda.is_available() else Platform.CPU


# The /proc/cpuinfo flags that give a CPU bfloat16 arithmetic: x86's AVX512-BF16 and AMX,
# Arm's BF16 (FEAT_BF16).
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
CPUINFO = Path("/proc/cpuinfo")


def cpu_has_bf16(cpuinfo: str | None = None) -> bool | None:
    """Whether the CPU has bfloat16 instructions, from /proc/cpuinfo's ``flags`` (x86) or
    ``Features`` (Arm) lines; None where there is no such file to tell (not Linux)."""
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text()
        except OSError:
            return None
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return bool(flags & BF16_CPU_FLAGS) if flags else None


# Settings left unset (None) take these: vLLM's own defaults, those of `vllm serve`.
# dtype auto: the checkpoint's own (bf16 for most; vLLM's CPU backend takes bf16 for a
# float32 checkpoint); compiled (enforce_eager False: CUDA graphs, or torch.compile on the
# CPU); max_num_seqs absent: vLLM's own default, so that continuous batching is not capped
# by the size of one dispatch batch. gpu_memory_utilization: vLLM's 0.9; unused on the CPU.
_VLLM_DEFAULTS: dict[Platform, dict[str, Any]] = {
    Platform.CUDA: {"dtype": "auto", "enforce_eager": False, "gpu_memory_utilization": 0.9, "max_num_seqs": None,
                    "scheduling_policy": "priority"},
    Platform.CPU: {"dtype": "auto", "enforce_eager": False, "gpu_memory_utilization": None, "max_num_seqs": None,
                   "scheduling_policy": "priority"},
}
# The transformers engine: bf16 on a GPU (a float32 checkpoint would stay float32 with
# "auto"), float32 on the CPU, where HF generate in bf16 was no faster (docs/benchmarks.md).
_HF_DTYPE = {Platform.CUDA: "bfloat16", Platform.CPU: "float32"}

PIPELINE = "pipeline (fixed)"
SETTING = "setting"
ENGINE_ARG = "engine argument"
LANES = "llmpipe's: priority lanes need it (vLLM's own fcfs refuses a priority)"
NO_BF16 = ("llmpipe's: this CPU has no bfloat16 instructions (avx512_bf16, amx_bf16, bf16), where vLLM's "
           "bfloat16 runs its matmuls ~90x slower than float32")


def _platform_source(p: Platform) -> str:
    return f"default on {p.value}"


def _vllm_source(p: Platform) -> str:
    return f"vLLM's own default on {p.value}, as `vllm serve`"


@dataclass
class EngineConfig:
    """What the engine of ``engine`` is built with on ``platform``; ``sources`` says where
    each argument came from (for ``llmpipe up --print-config``)."""

    engine: EngineKind
    platform: Platform
    args: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    fixed: dict[str, Any] = field(default_factory=dict)  # set by the engine itself; shown, never overridden

    def table(self) -> list[tuple[str, Any, str]]:
        """(argument, value, source) rows; the fixed ones last."""
        rows = [(k, v, self.sources.get(k, "")) for k, v in self.args.items()]
        return rows + [(k, v, PIPELINE) for k, v in self.fixed.items()]


def _pick(cfg: EngineConfig, name: str, setting: Any, default: Any) -> None:
    if setting is not None:
        cfg.args[name], cfg.sources[name] = setting, SETTING
    elif default is not None:
        source = _vllm_source if cfg.engine is EngineKind.VLLM else _platform_source
        cfg.args[name], cfg.sources[name] = default, source(cfg.platform)


def _pick_dtype(cfg: EngineConfig, setting: str | None, default: str, cpu_bf16: bool | None) -> None:
    """vLLM's dtype, except on a CPU known to lack bfloat16 instructions: float32 there."""
    if setting is None and cfg.platform is Platform.CPU:
        if cpu_bf16 is None:
            cpu_bf16 = cpu_has_bf16()
        if cpu_bf16 is False:
            cfg.args["dtype"], cfg.sources["dtype"] = "float32", NO_BF16
            return
    _pick(cfg, "dtype", setting, default)


def engine_config(s: Settings, platform: Platform | None = None, *, vllm_fields: dict[str, Any] | None = None,
                  cpu_bf16: bool | None = None) -> EngineConfig:
    """The effective engine arguments for ``s`` on ``platform`` (detected when None).

    ``cpu_bf16``: whether the CPU has bfloat16 instructions (read from /proc/cpuinfo when
    None; consulted on the CPU platform only). Raises EngineArgError for an engine argument
    vLLM does not have, one of the pipeline's own, or a value of the wrong type.
    ``vllm_fields`` (name -> type) stands in for vLLM's AsyncEngineArgs in unit tests."""
    if platform is None:
        platform = detect_platform()
    kind = EngineKind(s.engine)
    cfg = EngineConfig(kind, Platform(platform))
    if kind is EngineKind.VLLM:
        d = _VLLM_DEFAULTS[cfg.platform]
        _pick_dtype(cfg, s.dtype, d["dtype"], cpu_bf16)
        _pick(cfg, "max_model_len", s.max_model_len, None)
        _pick(cfg, "enforce_eager", s.enforce_eager, d["enforce_eager"])
        _pick(cfg, "gpu_memory_utilization", s.gpu_memory_utilization, d["gpu_memory_utilization"])
        n = len(s.served.models)
        shared_gpu = all(s.workers_of(m.name) == 1 for m in s.served.models)
        if s.gpu_memory_utilization is None and n > 1 and shared_gpu and cfg.platform is Platform.CUDA:
            # Several models (llmpipe/models/served.py): `llmpipe up` starts their engines on
            # the one GPU, and each takes its fraction of the whole GPU, so by default they
            # share the default's 0.9. Where each has a GPU of its own, set the setting; with
            # several workers of a model each worker has GPUs of its own (llmpipe/local/devices.py).
            cfg.args["gpu_memory_utilization"] = round(d["gpu_memory_utilization"] / n, 3)
            cfg.sources["gpu_memory_utilization"] = f"{_vllm_source(cfg.platform)}, shared by {n} models"
        _pick(cfg, "max_num_seqs", s.max_num_seqs, d["max_num_seqs"])
        if "max_num_seqs" not in cfg.args:
            cfg.sources["max_num_seqs"] = _vllm_source(cfg.platform)
        # Priority lanes hold inside the engine: requests carry their priority (llmpipe/jobs/lanes.py).
        # vLLM's own is fcfs, which refuses a priority.
        cfg.args["scheduling_policy"], cfg.sources["scheduling_policy"] = d["scheduling_policy"], LANES
        # The API refuses logprobs requests over this; vLLM must allow as many.
        cfg.args["max_logprobs"], cfg.sources["max_logprobs"] = s.max_logprobs, SETTING
        for k, v in convert_engine_args(s.engine_args, vllm_fields).items():
            cfg.args[k], cfg.sources[k] = v, ENGINE_ARG
        cfg.fixed = {"model": s.model, "skip_tokenizer_init": SKIP_TOKENIZER_INIT}
        return cfg
    if s.engine_args:
        raise EngineArgError(f"engine arguments ({', '.join(sorted(s.engine_args))}) are vLLM's; "
                             f"the {kind.value} engine takes none")
    if kind is EngineKind.TRANSFORMERS:
        _pick(cfg, "dtype", s.dtype, _HF_DTYPE[cfg.platform])
        cfg.args["device"], cfg.sources["device"] = cfg.platform.value, _platform_source(cfg.platform)
        _pick(cfg, "max_model_len", s.max_model_len, None)
        cfg.args["max_batch_size"], cfg.sources["max_batch_size"] = s.max_batch_size, SETTING
    return cfg


_SECRETS = ("flower_password", "api_keys")


def check_engine_args(s: Settings) -> None:
    """Raise EngineArgError for engine arguments that cannot work (before anything starts).
    Imports vLLM only when there are engine arguments to check: the settings that are engine
    arguments too are checked against vLLM's types in ALIAS_TYPES."""
    kind = EngineKind(s.engine)
    if s.engine_args and kind is not EngineKind.VLLM:
        raise EngineArgError(f"engine arguments ({', '.join(sorted(s.engine_args))}) are vLLM's; "
                             f"the {kind.value} engine takes none")
    # The settings that are engine arguments too (dtype, ...) are checked when given (a
    # default, such as max_logprobs' 20, is one vLLM takes).
    given = {k: getattr(s, k) for k in SETTING_ALIASES
             if getattr(s, k) is not None and getattr(s, k) != Settings.model_fields[k].default}
    if kind is EngineKind.VLLM:
        convert_engine_args(given, ALIAS_TYPES)
        convert_engine_args(s.engine_args)


def describe_config(s: Settings, platform: Platform | None = None) -> str:
    """``llmpipe up --print-config``: the effective settings, then the engine's arguments
    with where each came from."""
    import json

    detected = platform is None
    cfg = engine_config(s, platform)
    lines = ["# llmpipe settings (flags > LLMPIPE_* > config file > defaults; unset: chosen by platform)"]
    for name, value in s.model_dump(mode="json").items():
        if name == "engine_args":
            continue
        if name in _SECRETS and value:
            value = "***"
        by_platform = value is None and name in _VLLM_DEFAULTS[Platform.CPU]
        lines.append(f"{name} = {'(by platform)' if by_platform else json.dumps(value)}")
    how = "detected: torch sees a GPU" if cfg.platform is Platform.CUDA else "detected: torch sees no GPU"
    lines += ["", f"# engine {cfg.engine.value} on platform {cfg.platform.value} ({how if detected else 'given'})"]
    width = max((len(k) for k, _, _ in cfg.table()), default=0)
    for key, value, source in cfg.table():
        shown = json.dumps(value) if isinstance(value, (str, int, float, bool, dict, list)) else repr(value)
        lines.append(f"{key.ljust(width)} = {shown}  # {source}")
    for key, source in cfg.sources.items():
        if key not in cfg.args:
            lines.append(f"{key.ljust(width)} = (unset)  # {source}")
    return "\n".join(lines)


def cpu_environment(kv_cache_gib: float) -> dict[str, str]:
    """The variables of vLLM's that llmpipe sets on the CPU where they are unset.

    - VLLM_USE_AOT_COMPILE=0: vLLM 0.32's ahead-of-time compile artifacts do not load on
      the CPU ("Compiling model again due to a load failure ... 'function' object has no
      attribute 'finalize_loading'"), so every start compiled from scratch. Without them
      torch.compile goes through inductor's own cache, which a restart loads
      (docs/operations.md, "Engine defaults").
    - VLLM_CPU_KVCACHE_SPACE: vLLM's CPU platform reads it (whole GiB) and lets it win over
      kv_cache_memory_bytes; a fractional size goes through the engine argument instead."""
    env = {"VLLM_USE_AOT_COMPILE": "0"}
    if float(kv_cache_gib).is_integer() and kv_cache_gib >= 1:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_cache_gib))
    return env
