"""Guided decoding: ``response_format``, vLLM's ``structured_outputs`` and the older
``guided_*`` fields, as one StructuredOutput for the engine (vLLM's structured outputs).

vLLM's rules, with its messages: one kind of constraint per request (json, regex, choice,
grammar, json_object, structural_tag); ``response_format`` overrides the constraint of
``structured_outputs`` (vLLM's ``structured_outputs_from_response_format``); a named
``tool_choice`` takes no constraint of its own. The ``guided_*`` fields are vLLM's older
names for the same constraints (vLLM 0.32 dropped them and ignores them): llmpipe keeps
them as aliases, so that a client sending them gets the constraint it asked for, and
refuses them mixed with ``structured_outputs``.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from api.validation import Bool
from llmpipe.errors import BadRequestError
from llmpipe.messages import StructuredOutput

# vLLM's StructuredOutputsParams fields, in its order (its error message prints them).
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")
_ORDER = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace",
          "disable_additional_properties", "whitespace_pattern", "structural_tag")
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar",
          "guided_whitespace_pattern": "whitespace_pattern"}


class StructuredOutputsIn(BaseModel):
    """vLLM's ``structured_outputs``: exactly one constraint, and its options (checked in
    :func:`resolve`, after the request's own rules, as vLLM's order has it)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"oneOf": [
        {"required": [k], "properties": {k: {"not": {"type": "null"}}}} for k in _CONSTRAINTS]})

    json_: dict | str | None = Field(default=None, alias="json", description="A JSON schema (object or JSON text).")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(default=None, description="An EBNF (GBNF) or Lark grammar.")
    json_object: Bool | None = None
    disable_any_whitespace: Bool = False
    disable_additional_properties: Bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = Field(default=None, description="vLLM's structural tag, as JSON text.")

    def values(self) -> dict[str, Any]:
        return {"json": self.json_, **{k: getattr(self, k) for k in _ORDER if k != "json"}}


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict | None = Field(default=None, alias="schema")
    strict: Bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra={
        "if": {"properties": {"type": {"const": "json_schema"}}},
        "then": {"required": ["json_schema"], "properties": {"json_schema": {"type": "object"}}}})
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchema | None = None

    def override(self) -> dict[str, Any]:
        """What this format sets in vLLM's structured outputs (vLLM's overrides)."""
        if self.type == "text":
            return {}
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            if self.json_schema is None:
                raise BadRequestError("When response_format type is 'json_schema', the 'json_schema' field must be "
                                      "provided.", param="response_format")
            return {"json": self.json_schema.json_schema}
        return {"structural_tag": json.dumps(self.model_dump(by_alias=True, exclude_none=True))}


def _count_message(values: dict[str, Any]) -> str:
    shown = {**{k: values.get(k) for k in _ORDER}, "_backend": None, "_backend_was_auto": False}
    return str(shown)


def resolve(structured: StructuredOutputsIn | None, fmt: ResponseFormat | None, guided: dict[str, Any],
            tool_choice: Any = None) -> StructuredOutput | None:
    """The request's one constraint, or None; a 400 with vLLM's message for a conflict."""
    values = structured.values() if structured is not None else None
    given = {k: v for k, v in guided.items() if v is not None}
    if given.keys() <= {"guided_whitespace_pattern"}:
        given = {}  # an option without a constraint asks for nothing (vLLM ignores every guided_* field)
    if given:
        if values is not None:
            raise BadRequestError(f"{', '.join(sorted(given))} and structured_outputs both constrain the output: "
                                  "give one (the guided_* fields are the older names of structured_outputs)",
                                  param=sorted(given)[0])
        values = {k: None for k in _ORDER} | {"disable_any_whitespace": False, "disable_additional_properties": False}
        values.update({GUIDED[k]: v for k, v in given.items()})
    if values is not None:
        if sum(values.get(k) is not None for k in ("json", "regex", "choice")) > 1:
            raise BadRequestError("You can only use one kind of constraints for structured outputs ('json', 'regex' "
                                  "or 'choice').", param="structured_outputs")
        if isinstance(tool_choice, dict) and sum(values.get(k) is not None for k in ("json", "regex", "choice")):
            raise BadRequestError("You can only either use constraints for structured outputs or tools, not both.",
                                  param="structured_outputs")
        if structured is not None:
            _build(values)  # vLLM parses structured_outputs on its own first: exactly one constraint
    override = fmt.override() if fmt is not None else {}
    if not override:
        return _build(values) if values is not None else None
    return _build({**(values or {k: None for k in _ORDER}), **override})


def _build(values: dict[str, Any]) -> StructuredOutput:
    n = sum(values.get(k) is not None for k in _CONSTRAINTS)
    if n > 1:
        raise BadRequestError("You can only use one kind of structured outputs constraint but multiple are "
                              f"specified: {_count_message(values)}", param="structured_outputs")
    if n < 1:
        raise BadRequestError("You must use one kind of structured outputs constraint but none are specified: "
                              f"{_count_message(values)}", param="structured_outputs")
    return StructuredOutput(
        json_object=bool(values.get("json_object")), json_schema=values.get("json"), regex=values.get("regex"),
        choice=values.get("choice"), grammar=values.get("grammar"), structural_tag=values.get("structural_tag"),
        disable_any_whitespace=bool(values.get("disable_any_whitespace")),
        disable_additional_properties=bool(values.get("disable_additional_properties")),
        whitespace_pattern=values.get("whitespace_pattern"))
