"""Which of vLLM's parsers a served model uses, from the settings: ``tool_call_parser``,
``reasoning_parser``, ``enable_auto_tool_choice`` and ``tool_strict_level`` (as ``vllm
serve``'s flags) for every model, and ``model_parsers`` to set them per model by its served
name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmpipe.parsing import names

KEYS = ("tool_call_parser", "reasoning_parser", "enable_auto_tool_choice", "tool_strict_level")
# vLLM's ToolStrictLevel names (--tool-strict-level): how far a forced tool call's guided
# decoding pins the call. auto: the envelope, and the arguments of tools marked strict;
# function: the envelope on every request with tools; parameter: every tool's arguments too.
STRICT_LEVELS = ("auto", "function", "parameter")


@dataclass(frozen=True)
class ModelParsers:
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    enable_auto_tool_choice: bool = False
    tool_strict_level: str = "auto"

    @property
    def tools(self) -> str | None:
        """The tool parser vLLM loads: only with auto tool choice enabled (vLLM's ParserManager)."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None

    @property
    def any(self) -> bool:
        """Whether vLLM's chat server would build a parser for this model at all."""
        return bool(self.tools or self.reasoning_parser)

    def check(self, where: str) -> None:
        """ValueError naming the setting, as vLLM's start refuses the same flags."""
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError(f"{where}enable_auto_tool_choice requires tool_call_parser (vLLM: --enable-auto-tool-choice "
                             "requires --tool-call-parser)")
        if self.tool_strict_level not in STRICT_LEVELS:
            raise ValueError(f"{where}tool_strict_level {self.tool_strict_level!r} is not one of vLLM's levels "
                             f"({', '.join(STRICT_LEVELS)})")
        try:
            names.check("tool_call_parser", self.tool_call_parser)
            names.check("reasoning_parser", self.reasoning_parser)
        except ValueError as exc:
            raise ValueError(f"{where}{exc}") from None


def resolve(defaults: ModelParsers, overrides: dict[str, dict[str, Any]], model: str) -> ModelParsers:
    """``model``'s parsers: its entry in ``model_parsers`` over the defaults."""
    own = overrides.get(model) or {}
    unknown = set(own) - set(KEYS)
    if unknown:
        raise ValueError(f"model_parsers.{model}: unknown key(s) {sorted(unknown)}; allowed: {', '.join(KEYS)}")
    return ModelParsers(**{k: own.get(k, getattr(defaults, k)) for k in KEYS})
