"""The two `vllm serve` modes' command lines (llmpipe/bench/vllm_serve.py): as typed, no flag
but the host and the port; matched, the pipeline's effective engine arguments, as vLLM's own
`vllm serve` parser reads them."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmpipe.bench.modes import MODES, EngineSetup
from llmpipe.bench.vllm_serve import flags, matched_argv, pipeline_engine_args, serve_argv
from llmpipe.engines.platform import Platform
from llmpipe.settings import EngineKind, Settings

MODEL = "/models/smollm2"


def _settings(mode: str, tmp_path: Path, **kw) -> Settings:
    setup = EngineSetup(key="real", kind=EngineKind.VLLM, label="real", model_path=MODEL, max_model_len=None)
    s = setup.settings(MODES[mode], "redis://127.0.0.1:1/0", tmp_path)
    return s.model_copy(update=kw)


def test_vllm_serve_is_the_model_host_and_port_only(tmp_path):
    s = _settings("vllm-serve", tmp_path)
    # The name the pipeline answers to is the model as given, which is vLLM's own default name.
    assert s.served.default.id == MODEL
    argv = serve_argv(MODEL, 8123, s.served.default.id)
    assert argv[1:] == ["-m", "llmpipe.cli.vllm", "serve", MODEL, "--host", "127.0.0.1", "--port", "8123"]


def test_a_served_name_other_than_the_model_is_the_one_flag_added():
    argv = serve_argv(MODEL, 8123, "smollm2")
    assert argv[4:] == [MODEL, "--host", "127.0.0.1", "--port", "8123", "--served-model-name", "smollm2"]


def test_matched_mode_gives_the_pipelines_engine_arguments(tmp_path):
    s = _settings("vllm-serve-matched", tmp_path, dtype="float32", enforce_eager=True, max_num_seqs=8,
                  engine_args={"max_num_batched_tokens": 4096})
    argv = matched_argv(MODEL, 8123, s, MODEL)
    assert argv[:9] == serve_argv(MODEL, 8123)
    extra = argv[9:]
    for pair in (["--dtype", "float32"], ["--max-num-seqs", "8"], ["--max-num-batched-tokens", "4096"],
                 ["--scheduling-policy", "priority"], ["--seed", "0"], ["--max-logprobs", "20"]):
        i = extra.index(pair[0])
        assert extra[i:i + 2] == pair
    assert "--enforce-eager" in extra and "--disable-log-stats" in extra
    assert "--max-model-len" not in extra  # unset in the pipeline too: the model's own
    assert "--skip-tokenizer-init" not in extra and "--model" not in extra  # the server tokenizes text itself


def test_matched_mode_on_the_shipped_defaults_is_compiled_and_vllms_dtype(tmp_path, monkeypatch):
    monkeypatch.setattr("llmpipe.engines.platform.cpu_has_bf16", lambda: True)
    extra = matched_argv(MODEL, 8123, _settings("vllm-serve-matched", tmp_path))[9:]
    assert extra[extra.index("--dtype") + 1] == "auto"
    assert "--no-enforce-eager" in extra and "--max-num-seqs" not in extra
    monkeypatch.setattr("llmpipe.engines.platform.cpu_has_bf16", lambda: False)  # an AVX2-only CPU
    extra = matched_argv(MODEL, 8123, _settings("vllm-serve-matched", tmp_path))[9:]
    assert extra[extra.index("--dtype") + 1] == "float32"


def test_flags_spell_values_as_vllms_cli_takes_them():
    assert flags({"enforce_eager": False, "disable_log_stats": False, "max_num_seqs": None}) == ["--no-enforce-eager"]
    assert flags({"compilation_config": {"level": 0}}) == ["--compilation-config", '{"level": 0}']
    assert flags({"model": "x", "skip_tokenizer_init": False, "tensor_parallel_size": 2}) == [
        "--tensor-parallel-size", "2"]


def test_vllms_own_serve_parser_reads_both_command_lines(tmp_path):
    """The argv goes through `vllm serve`'s own argument parser: as typed it leaves every
    engine argument at vLLM's default; matched it sets each of the pipeline's."""
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))

    def engine(argv: list[str]) -> AsyncEngineArgs:
        args = parser.parse_args(argv[3:])
        args.model = args.model_tag  # as ServeSubcommand.cmd does
        return AsyncEngineArgs.from_cli_args(args)

    model = str(tmp_path / "smollm2")  # a folder here, not a hub id vLLM would look up
    (tmp_path / "smollm2").mkdir()
    typed = parser.parse_args(serve_argv(model, 8123)[3:])
    assert (typed.host, typed.port, typed.model_tag) == ("127.0.0.1", 8123, model)
    assert engine(serve_argv(model, 8123)) == engine(["python", "-m", "vllm", "serve", model])
    s = _settings("vllm-serve-matched", tmp_path, dtype="float32", enforce_eager=True, max_num_seqs=8)
    matched = engine(matched_argv(model, 8123, s))
    want = pipeline_engine_args(s)
    assert {k: getattr(matched, k) for k in want} == want


def test_pipeline_engine_args_are_the_platforms_and_the_engines_own(tmp_path, monkeypatch):
    monkeypatch.setattr("llmpipe.engines.platform.detect_platform", lambda: Platform.CPU)
    monkeypatch.setattr("llmpipe.engines.platform.cpu_has_bf16", lambda: True)
    args = pipeline_engine_args(_settings("vllm-serve-matched", tmp_path))
    assert args["dtype"] == "auto" and args["enforce_eager"] is False and "max_num_seqs" not in args
    assert args["kv_cache_memory_bytes"] == 1 << 30 and args["seed"] == 0 and args["disable_log_stats"] is True
