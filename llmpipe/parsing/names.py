"""The parser names vLLM registers (``--tool-call-parser``, ``--reasoning-parser``), read
from vLLM's own registration tables without importing vLLM: importing its parser modules
pulls in torch and transformers (seconds), and the API checks the settings at start too.

vLLM registers its built-in parsers lazily from one dict per kind
(``_TOOL_PARSERS_TO_REGISTER`` in vllm/tool_parsers/__init__.py,
``_REASONING_PARSERS_TO_REGISTER`` in vllm/reasoning/__init__.py); its keys are the names."""

from __future__ import annotations

import ast
import importlib.util
from functools import cache
from pathlib import Path

_TABLES = {"tool_call_parser": ("tool_parsers", "_TOOL_PARSERS_TO_REGISTER"),
           "reasoning_parser": ("reasoning", "_REASONING_PARSERS_TO_REGISTER")}


@cache
def registered(setting: str) -> frozenset[str] | None:
    """The names ``setting`` ("tool_call_parser" or "reasoning_parser") may take; None when
    vLLM is not installed here (the workers that parse check them when they load a parser)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder, table = _TABLES[setting]
    source = Path(next(iter(spec.submodule_search_locations))) / folder / "__init__.py"
    tree = ast.parse(source.read_text())
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0] if isinstance(node, ast.Assign) else None
        if isinstance(target, ast.Name) and target.id == table and isinstance(node.value, ast.Dict):
            return frozenset(k.value for k in node.value.keys if isinstance(k, ast.Constant))
    raise RuntimeError(f"vLLM's {table} was not found in {source}: this vLLM registers its parsers another way")


def check(setting: str, name: str | None) -> None:
    """ValueError naming the setting for a parser vLLM does not have."""
    if not name:
        return
    names = registered(setting)
    if names is not None and name not in names:
        raise ValueError(f"{setting} {name!r} is not one of vLLM's parsers: {', '.join(sorted(names))}")
