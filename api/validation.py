"""Request limits and JSON types: one definition for the validation and the OpenAPI schema.

A limit that depends on the settings (``max_tokens_limit``, ``max_n``, ...) is written
into a model's annotation as ``Limit("max_tokens_limit")``. The app binds its settings
(:func:`bind`): every request is validated against them, and ``/openapi.json`` states
them (``maximum``, ``maxLength``, ``maxItems``), so the schema says what is enforced.
A request over a limit is 400 ``limit_exceeded``, naming the setting.

The field types follow JSON: pydantic's lax mode takes ``"5"`` for an int and ``"yes"``
for a bool, which the schema calls invalid; ``Int``, ``Float`` and ``Bool`` take only
JSON numbers (an integral float for an int, as JSON Schema's ``integer``) and booleans.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, fields
from functools import cache
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, GetCoreSchemaHandler, GetJsonSchemaHandler, StrictBool, ValidationError
from pydantic_core import PydanticCustomError, core_schema
from tokenizers import Tokenizer

from llmpipe.errors import BadRequestError, LimitExceededError
from llmpipe.jobs.lanes import PRIORITY_MAX, PRIORITY_MIN
from llmpipe.models.registry import SMOLLM2_DIR, TINY_DIR
from llmpipe.settings import Settings


def _json_number(v: Any) -> Any:
    if isinstance(v, (str, bool, bytes)):
        raise PydanticCustomError("json_type", "Input should be a JSON number")
    return v


_NUMBER = BeforeValidator(_json_number)  # last, so that Field's constraints reach the schema


def Int(*markers: Any, **constraints: Any) -> Any:  # noqa: N802 - used as a type
    """A JSON integer (an integral float too, as JSON Schema's ``integer``), with Field's
    constraints and then ``markers`` (a Limit)."""
    return Annotated[(int, Field(**constraints), *markers, _NUMBER)]


def Float(*markers: Any, **constraints: Any) -> Any:  # noqa: N802 - used as a type
    """A JSON number, never a numeric string."""
    return Annotated[(float, Field(**constraints), *markers, _NUMBER)]


Bool = StrictBool

MAX_TOKEN_ID = 2**32 - 1  # token ids are 32-bit in every tokenizer (vLLM refuses larger)
TokenId = Int(ge=0, le=MAX_TOKEN_ID)
# vLLM takes a torch long; the schema keeps to JSON's exact integers (I-JSON, RFC 7493), as
# JSON tools (and schema validators) read larger numbers as floats and cannot tell them apart.
Seed = Int(ge=-(2**53 - 1), le=2**53 - 1)
# vLLM's priority extension field: lower is sooner; the lane follows (llmpipe/jobs/lanes.py).
Priority = Int(ge=PRIORITY_MIN, le=PRIORITY_MAX, description=(
    f"vLLM's priority: lower is scheduled sooner, {PRIORITY_MIN} to {PRIORITY_MAX}. Below the server's "
    "lane_batch_priority (default 1) the request is in the interactive lane, else in the batch lane, which is "
    "claimed after interactive work and refused (429) first under load."))


@dataclass(frozen=True)
class Limits:
    """The request limits of one app, from its settings."""

    max_tokens_limit: int = Settings.model_fields["max_tokens_limit"].default
    max_n: int = Settings.model_fields["max_n"].default
    max_prompts_per_job: int = Settings.model_fields["max_prompts_per_job"].default
    max_prompt_chars: int = Settings.model_fields["max_prompt_chars"].default
    max_logprobs: int = Settings.model_fields["max_logprobs"].default  # -1: unlimited, as vLLM
    # Whether a served model has a tool parser: without one a tool_choice other than "none" is 400.
    tool_parser: bool = True
    trust_request_chat_template: bool = Settings.model_fields["trust_request_chat_template"].default
    # The largest token id a prompt may hold (None: unknown, the model is not at hand).
    vocab: Callable[[], int | None] = field(default=lambda: None, compare=False)

    @classmethod
    def from_settings(cls, s: Settings, model_path: Callable[[], str] | None = None,
                      model_paths: list[Callable[[], str]] | None = None) -> Limits:
        """``model_paths``: with several models the schema's token-id bound is the largest
        vocabulary of them (preprocess checks each request against its own model's)."""
        names = {f.name for f in fields(cls)} - {"vocab", "tool_parser"}
        tool_parser = any(s.parsers(m.name).tools is not None for m in s.served.models)
        if model_paths:
            def vocab() -> int | None:
                sizes = [_vocab_size(p()) for p in model_paths]
                return None if None in sizes else max(sizes)
        else:
            vocab = (lambda: _vocab_size(model_path())) if model_path else (lambda: None)
        return cls(**{n: getattr(s, n) for n in names}, tool_parser=tool_parser, vocab=_quiet(vocab))

    def value(self, name: str) -> int | None:
        if name == "max_token_id":
            v = self.vocab()
            return None if v is None else v - 1
        return getattr(self, name)


def _quiet(fn: Callable[[], int | None]) -> Callable[[], int | None]:
    done: list[int | None] = []

    def get() -> int | None:
        if not done:
            try:
                done.append(fn())
            except Exception:  # the model cannot be read: the limit is left out
                done.append(None)
        return done[0]

    return get


def prepared_model_path(s: Settings, source: str | None = None) -> str:
    """The model's folder if it is already on disk; never prepares (converts, builds) one.
    ``source``: a served model's (default: the ``model`` setting)."""
    source = source if source is not None else s.model
    alias = {"tiny": TINY_DIR, "smollm2": SMOLLM2_DIR}.get(source.strip().lower())
    path = s.models_dir / alias if alias else Path(source).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(path)
    return str(path)


@cache
def _vocab_size(path: str) -> int | None:
    """As preprocess counts it: the larger of the model's vocabulary and the tokenizer's."""
    p = Path(path)
    sizes = []
    if (p / "config.json").is_file():
        cfg = json.loads((p / "config.json").read_text())
        sizes.append(cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size") or 0)
    if (p / "tokenizer.json").is_file():
        sizes.append(Tokenizer.from_file(str(p / "tokenizer.json")).get_vocab_size(with_added_tokens=True))
    return max(sizes) if sizes and max(sizes) > 0 else None


_CURRENT: ContextVar[Limits | None] = ContextVar("llmpipe_limits", default=None)
_DEFAULT = Limits()


def current() -> Limits:
    v = _CURRENT.get()
    return _DEFAULT if v is None else v


_KEYWORDS = {"value": "maximum", "length": "maxLength", "items": "maxItems"}


@dataclass(frozen=True)
class Limit:
    """``Annotated[int, Limit("max_tokens_limit")]``: at most the app's setting.

    ``of``: what is measured, the value itself, a string's ``length`` or a list's ``items``.
    ``param``: the request field the error names."""

    setting: str
    of: str = "value"
    param: str | None = None

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self._check, handler(source))

    def __get_pydantic_json_schema__(self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler) -> dict:
        js = handler(schema)
        limit = current().value(self.setting)
        if limit is not None and limit >= 0:
            js[_KEYWORDS[self.of]] = limit
        return js

    def _check(self, v: Any) -> Any:
        limit = current().value(self.setting)
        if v is None or limit is None or limit < 0:
            return v
        size = v if self.of == "value" else len(v)
        if size > limit:
            if self.setting == "max_token_id":
                raise BadRequestError(f"Token id {v} is out of vocabulary", param=self.param)
            what = {"value": self.param or "the value", "length": f"a {self.param or 'text'} (in characters)",
                    "items": f"{self.param or 'the list'} (in items)"}[self.of]
            raise LimitExceededError(f"{what} may be at most {limit} ({self.setting}); got {size}", param=self.param)
        return v


@dataclass(frozen=True)
class LogprobsRange:
    """How many log probabilities per token a request may ask: 0 to ``max_logprobs``, or
    any (-1: the whole vocabulary) when ``max_logprobs`` is -1, as vLLM checks."""

    param: str
    kind: str  # "sample" or "prompt", as vLLM's message says
    over_param: str | None = None  # the field vLLM names for a count over the maximum, if another

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self._check, handler(source))

    def __get_pydantic_json_schema__(self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler) -> dict:
        js = handler(schema)
        top = current().max_logprobs
        js["minimum"] = -1 if top == -1 else 0
        if top != -1:
            js["maximum"] = top
        return js

    def _check(self, v: Any) -> Any:
        if v is None:
            return v
        top = current().max_logprobs
        if v < -1:
            raise BadRequestError(f"`{self.param}` must be a positive value or -1.", param=self.param)
        if top != -1 and (v == -1 or v > top):
            raise BadRequestError(f"Requested {self.kind} logprobs of {v}, which is greater than max allowed: {top}",
                                  param=self.over_param or self.param)
        return v


def upto_pattern(n: int) -> str:
    """A regular expression (no anchors) for the decimal integers 0 to ``n``, no leading zeros."""
    digits = str(n)
    alts = ["0"] if n >= 0 else []
    for width in range(1, len(digits)):  # every number with fewer digits
        alts.append("[1-9]" + ("[0-9]" * (width - 1)))
    for i, d in enumerate(digits):  # as many digits: the same prefix, then a smaller digit
        low = 1 if i == 0 else 0
        if int(d) > low:
            alts.append(digits[:i] + f"[{low}-{int(d) - 1}]" + "[0-9]" * (len(digits) - i - 1))
    if n > 0:
        alts.append(digits)
    return "(" + "|".join(dict.fromkeys(alts)) + ")"


@dataclass(frozen=True)
class InVocab:
    """Schema only: a token id (``of`` "value") or a token id written as an object's key
    ("key", as ``logit_bias`` has them) is at most the model's largest. Preprocess refuses
    the rest with vLLM's message, which names the vocabulary."""

    of: str = "value"

    def __get_pydantic_json_schema__(self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler) -> dict:
        js = handler(schema)
        top = current().value("max_token_id")
        if top is None:
            return js
        if self.of == "value":
            js["maximum"] = top
        else:  # as int() reads a key: spaces around it and a plus sign are taken
            js["propertyNames"] = {"pattern": rf"^\s*\+?0*{upto_pattern(top)}\s*$"}
        return js


@dataclass(frozen=True)
class OnlyWhen:
    """Schema only: without the server's ``flag`` (a Limits field from the settings) the field
    takes just ``allowed``; the request's checks give vLLM's 400 for the rest."""

    flag: str
    allowed: tuple
    why: str

    def __get_pydantic_json_schema__(self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler) -> dict:
        js = handler(schema)
        if getattr(current(), self.flag):
            return js
        return {"enum": list(self.allowed), "description": self.why}


# tool_choice without a tool parser on any served model: "none" only (api/openai/chat.py).
NEEDS_TOOL_PARSER = OnlyWhen("tool_parser", ("none", None), 'Only "none": no served model has a tool parser (the '
                             "tool_call_parser and enable_auto_tool_choice settings).")
# A request's own chat template needs the server's trust_request_chat_template.
NEEDS_TRUST = OnlyWhen("trust_request_chat_template", (None,), "Not taken: the server does not trust a request's "
                       "chat template (the trust_request_chat_template setting).")


@contextmanager
def limits_scope(limits: Limits) -> Iterator[None]:
    """Validate against ``limits`` outside a request (the Batch API checks each line's body as
    its endpoint would)."""
    token = _CURRENT.set(limits)
    try:
        yield
    finally:
        _CURRENT.reset(token)


class LimitsScope:
    """ASGI middleware: requests of this app are validated against its limits."""

    def __init__(self, app, limits: Limits):
        self.app = app
        self.limits = limits

    async def __call__(self, scope, receive, send):
        token = _CURRENT.set(self.limits)
        try:
            await self.app(scope, receive, send)
        finally:
            _CURRENT.reset(token)


def bind(app, limits: Limits, post_process: Callable[[dict], None] | None = None) -> None:
    """Validate ``app``'s requests against ``limits`` and state them in its OpenAPI schema."""
    app.add_middleware(LimitsScope, limits=limits)
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            token = _CURRENT.set(limits)
            try:
                spec = build()
                if post_process is not None:
                    post_process(spec)
            finally:
                _CURRENT.reset(token)
        return app.openapi_schema

    app.openapi = openapi


@dataclass(frozen=True)
class OneError:
    """A union's errors as one error on the field itself, as vLLM names the field (pydantic
    would name each member). Errors that are not validation errors (a Limit's) pass."""

    what: str

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        def wrap(v: Any, nxt: core_schema.ValidatorFunctionWrapHandler) -> Any:
            try:
                return nxt(v)
            except ValidationError as exc:
                first = exc.errors()[0]["msg"] if exc.errors() else "invalid"
                raise PydanticCustomError("invalid_input", "{what} ({first})", {"what": self.what, "first": first}) from None

        return core_schema.no_info_wrap_validator_function(wrap, handler(source))


def allowed_values(values: dict[str, tuple]) -> dict[str, dict]:
    """JSON Schema properties for fields accepted only with the given values."""
    return {name: {"enum": list(vals), "description": "Not supported by llmpipe: only these values, which ask for nothing."}
            for name, vals in values.items()}


def same_json(a: Any, b: Any) -> bool:
    """Equal as JSON values are: 0 == 0.0, but false is no 0."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b
