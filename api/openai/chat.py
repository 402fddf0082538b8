"""The chat request's conversation, tools and chat-template fields, with vLLM's rules and
messages (its ChatCompletionRequest validators): the ``tool`` role and assistant messages
with ``tool_calls`` in the history, ``tools`` and ``tool_choice`` (and OpenAI's older
``functions`` / ``function_call``, turned into them), and the chat template's fields,
which preprocess renders (llmpipe/processors/chat_render.py)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from api.validation import NEEDS_TOOL_PARSER, NEEDS_TRUST, Bool, Limit
from llmpipe.errors import BadRequestError
from llmpipe.messages import ChatMessage, ChatTemplate, FunctionCall, OutputParsing, ToolCall
from llmpipe.settings import Settings

_Chars = Limit("max_prompt_chars", "length", param="messages")
_CORRECT = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


class TextPart(BaseModel):
    type: Literal["text"]
    text: Annotated[str, _Chars]


class FunctionCallIn(BaseModel):
    name: str
    arguments: str | dict = "{}"  # JSON text, as OpenAI sends it (an object is taken too, as vLLM does)


class ToolCallIn(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatIn(BaseModel):
    """One message of the conversation (vLLM's ChatCompletionMessageParam, text only)."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Annotated[str, _Chars] | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = Field(default=None, description="An assistant's reasoning (vLLM; reasoning_content too).")
    function_call: FunctionCallIn | None = Field(default=None, description="OpenAI's older form of tool_calls.")

    def pieces(self) -> list[str]:
        """The texts max_prompt_chars limits, as the schema states it: the content, or each part."""
        if self.content is None:
            return []
        return [self.content] if isinstance(self.content, str) else [p.text for p in self.content]

    def to_message(self) -> ChatMessage:
        """As vLLM gives a string-content template the message: text parts joined by newlines."""
        text = self.content if isinstance(self.content, str) or self.content is None else "\n".join(
            p.text for p in self.content)
        calls = self.tool_calls
        if calls is None and self.function_call is not None:
            calls = [ToolCallIn(id=f"call_{self.function_call.name}", function=self.function_call)]
        return ChatMessage(
            role=self.role, content=text, name=self.name, tool_call_id=self.tool_call_id, reasoning=self.reasoning,
            tool_calls=None if calls is None else [
                ToolCall(id=c.id, function=FunctionCall(name=c.function.name, arguments=c.function.arguments
                                                        if isinstance(c.function.arguments, str)
                                                        else json.dumps(c.function.arguments)))
                for c in calls])


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = Field(default=None, description="A JSON Schema for the arguments.")
    strict: Bool | None = None

    @field_validator("parameters")
    @classmethod
    def _schema(cls, v: dict | None) -> dict | None:
        if v is not None:
            from jsonschema import SchemaError, validators

            try:
                validators.validator_for(v).check_schema(v)
            except SchemaError as exc:
                raise BadRequestError(f"the function's parameters are not a valid JSON Schema: {exc.message}",
                                      param="tools") from None
        return v

    def dumped(self) -> dict:
        """As vLLM hands it to the chat template (its FunctionDefinition's dump)."""
        out = {"name": self.name, "description": self.description, "parameters": self.parameters}
        if self.strict is not None:
            out["strict"] = self.strict
        return out


class ToolIn(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDef

    def dumped(self) -> dict:
        return {"type": "function", "function": self.function.dumped()}


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    function: NamedFunction
    type: Literal["function"] = "function"


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice | None


def legacy_functions(data: Any) -> Any:
    """OpenAI's ``functions`` / ``function_call`` as ``tools`` / ``tool_choice``."""
    if not isinstance(data, dict) or (data.get("functions") is None and data.get("function_call") is None):
        return data
    if data.get("tools") is not None or data.get("tool_choice") is not None:
        raise BadRequestError("give tools and tool_choice, or the older functions and function_call, not both",
                              param="functions")
    data = dict(data)
    functions, call = data.pop("functions", None), data.pop("function_call", None)
    if functions is not None:
        if not isinstance(functions, list):
            raise BadRequestError("functions must be a list of function definitions", param="functions")
        data["tools"] = [{"type": "function", "function": f} for f in functions]
    if call is not None:
        data["tool_choice"] = ({"type": "function", "function": call} if isinstance(call, dict) else call)
    data["legacy_functions"] = True
    return data


# vLLM's rules between the chat fields, as JSON Schema (check_tool_usage and
# check_generation_prompt enforce them with vLLM's messages): a tool_choice other than
# "none" needs tools, and a prefill (continue_final_message) adds no generation prompt.
CHAT_RULES = [
    {"anyOf": [{"properties": {"tool_choice": {"enum": ["none", None]}}},
               {"required": ["tools"], "properties": {"tools": {"type": "array"}}}]},
    {"anyOf": [{"properties": {"continue_final_message": {"const": False}}},
               {"properties": {"add_generation_prompt": {"const": False}}}]},
]


def check_tool_usage(data: Any) -> Any:
    """vLLM's check_tool_usage, on the raw body: tool_choice needs tools, names one of them,
    and defaults to "auto" when tools are given."""
    if not isinstance(data, dict):
        return data
    if data.get("tools") == []:
        raise BadRequestError("`tools` must not be an empty array. Either provide at least one tool or omit the "
                              "field entirely.", param="tools")
    if "tool_choice" not in data and data.get("tools"):
        data = {**data, "tool_choice": "auto"}
    choice = data.get("tool_choice")
    if choice is None or choice == "none":
        return data
    if data.get("tools") is None:
        raise BadRequestError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        raise BadRequestError(f"Invalid value for `tool_choice`: {choice}! Only named tools, \"none\", \"auto\" or "
                              "\"required\" are supported.", param="tool_choice")
    if isinstance(choice, dict):
        _check_named(choice, data["tools"])
    return data


def _check_named(choice: dict, tools: Any) -> None:
    function = choice.get("function")
    if not isinstance(function, dict):
        raise BadRequestError(f"Invalid value for `function`: `{function}` in `tool_choice`! {_CORRECT}",
                              param="tool_choice.function")
    if "name" not in function:
        raise BadRequestError(f"Expected field `name` in `function` in `tool_choice`! {_CORRECT}",
                              param="tool_choice.function.name")
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise BadRequestError(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_CORRECT}",
                              param="tool_choice.function.name")
    names = [t.get("function", {}).get("name") for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)]
    if name not in names:
        raise BadRequestError("The tool specified in `tool_choice` does not match any of the specified `tools`",
                              param="tool_choice")


def check_generation_prompt(data: Any) -> Any:
    if isinstance(data, dict) and data.get("continue_final_message") and data.get("add_generation_prompt"):
        raise BadRequestError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                              param="continue_final_message")
    return data


def reasoning_alias(data: Any) -> Any:
    """vLLM renames an assistant message's deprecated ``reasoning_content`` to ``reasoning``."""
    if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
        return data
    msgs = []
    for m in data["messages"]:
        if isinstance(m, dict) and "reasoning_content" in m:
            m = dict(m)
            rc = m.pop("reasoning_content")
            if rc is not None and m.get("reasoning") is None:
                m["reasoning"] = rc
        msgs.append(m)
    return {**data, "messages": msgs}


class ChatFields(BaseModel):
    """vLLM's chat-only fields: tools and the chat template."""

    tools: list[ToolIn] | None = Field(default=None, min_length=1)
    tool_choice: Annotated[ToolChoice, NEEDS_TOOL_PARSER] = Field(default="none", description='"none", "auto" (needs the model\'s tool_call_parser), '
                                    '"required" or a named function (both through guided decoding, as vLLM).')
    parallel_tool_calls: Bool | None = True
    include_reasoning: Bool = Field(default=True, description="vLLM: include the reasoning parser's reasoning.")
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    add_generation_prompt: Bool = True
    continue_final_message: Bool = Field(default=False, description="Continue the last message (a prefill).")
    add_special_tokens: Bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: Annotated[str | None, NEEDS_TRUST] = Field(default=None, description="A Jinja template; needs the server's "
                                      "trust_request_chat_template (vLLM's --trust-request-chat-template).")
    chat_template_kwargs: Annotated[dict[str, Any], Field(json_schema_extra={
        "propertyNames": {"not": {"enum": ["chat_template", "tokenize"]}}})] | None = Field(
        default=None, description="The chat template's variables (e.g. enable_thinking), not chat_template or tokenize.")

    def check_chat(self, s: Settings, model: str | None) -> None:
        """What needs the server's settings: vLLM's rule that a tool_choice other than "none"
        needs the model's tool parser (its 400s), and the trust in a request's chat template."""
        self.chat_template_options(s.trust_request_chat_template)
        choice = self.tool_choice_value()
        if choice in (None, "none") or s.parsers(model).tools is not None:
            return
        hint = " (llmpipe: the enable_auto_tool_choice and tool_call_parser settings)"
        if choice == "auto":
            raise BadRequestError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
                                  + hint, param="tool_choice")
        desc = f'function "{choice["function"]["name"]}"' if isinstance(choice, dict) else f'"{choice}"'
        raise BadRequestError(f"tool_choice={desc} requires --tool-call-parser to be set" + hint, param="tool_choice")

    def tool_choice_value(self) -> str | dict | None:
        c = self.tool_choice
        return c.model_dump() if isinstance(c, NamedToolChoice) else c

    def template_kwargs(self) -> dict[str, Any]:
        """vLLM's effective chat template kwargs: the request's, under its explicit fields."""
        user = dict(self.chat_template_kwargs or {})
        extra: dict[str, Any] = {"add_generation_prompt": self.add_generation_prompt,
                                 "continue_final_message": self.continue_final_message,
                                 "documents": self.documents, "reasoning_effort": self.reasoning_effort}
        if self.reasoning_effort is not None and "enable_thinking" not in user:
            extra["enable_thinking"] = self.reasoning_effort != "none"
        return user | {k: v for k, v in extra.items() if v not in (None, "auto")}

    def chat_template_options(self, trusted: bool) -> ChatTemplate:
        kwargs = self.template_kwargs()
        if not trusted and (self.chat_template is not None or kwargs.get("chat_template") is not None):
            raise BadRequestError("Chat template is passed with request, but --trust-request-chat-template is not set. "
                                  "Refused request with untrusted chat template.", param="chat_template")
        bad = {"chat_template", "tokenize"} & (self.chat_template_kwargs or {}).keys()
        if bad:
            raise BadRequestError(f"Found unexpected chat template kwargs from request: {bad}",
                                  param="chat_template_kwargs")
        return ChatTemplate(tools=None if self.tools is None else [t.dumped() for t in self.tools],
                            documents=self.documents, chat_template=self.chat_template,
                            kwargs={k: v for k, v in kwargs.items()
                                    if k not in ("add_generation_prompt", "continue_final_message", "documents")},
                            add_generation_prompt=self.add_generation_prompt,
                            continue_final_message=self.continue_final_message,
                            add_special_tokens=self.add_special_tokens)

    def output_parsing(self) -> OutputParsing:
        return OutputParsing(tools=None if self.tools is None else [t.dumped() for t in self.tools],
                             tool_choice=self.tool_choice_value(), parallel_tool_calls=self.parallel_tool_calls,
                             include_reasoning=self.include_reasoning, template_kwargs=self.template_kwargs())
