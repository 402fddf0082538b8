"""A chat request's prompt text, rendered with the model's tokenizer as vLLM renders it for
a Hugging Face model (vllm/renderers/hf.py, chat_utils.py): the messages as vLLM's
conversation (text parts joined by newlines, an assistant's tool_calls with their arguments
as objects, ``reasoning`` and ``reasoning_content``, a tool result's ``tool_call_id``),
``developer`` messages made ``system`` when the template does not know the role, the
request's chat template kwargs kept to what the template reads, and
``apply_chat_template(tokenize=False)`` with ``tools``, ``documents``,
``add_generation_prompt`` and ``continue_final_message``. A template that raises (jinja's
``raise_exception``, a kwarg it refuses) is the client's fault: a 400 with its reason.
"""

from __future__ import annotations

import inspect
import json
from functools import lru_cache
from typing import Any

from llmpipe.errors import BadRequestError
from llmpipe.messages import ChatMessage, ChatTemplate

# Passed to apply_chat_template by name, never through the kwargs.
_OWN = frozenset({"conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
                  "tokenize", "return_dict", "return_tensors", "padding", "truncation", "max_length",
                  "return_assistant_tokens_mask", "tokenizer_kwargs", "kwargs"})


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """vLLM's ConversationMessage dicts for a string-content template."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.role == "assistant" and m.tool_calls:
            # In the order of OpenAI's typed dicts, which vLLM's request keeps: a template's
            # ``tojson`` of a call shows it.
            d["tool_calls"] = [{"id": c.id, "function": {"arguments": _arguments(c.function.arguments),
                                                         "name": c.function.name}, "type": c.type}
                               for c in m.tool_calls]
        if m.role == "assistant" and m.reasoning is not None:
            d["reasoning"] = d["reasoning_content"] = m.reasoning
        if m.role == "tool" and m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


def _arguments(text: str) -> dict:
    """vLLM's: a call's arguments as an object for the template; not JSON, or not an object: {}."""
    if not text:
        return {}
    try:
        parsed = json.loads(text)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def template_of(tokenizer: Any, chat: ChatTemplate) -> str:
    """The Jinja text that renders (the request's, a named one of the tokenizer's, or its default)."""
    try:
        return tokenizer.get_chat_template(chat.chat_template, tools=chat.tools)
    except ValueError as exc:
        raise BadRequestError(str(exc), param="chat_template") from None


def developer_as_system(conv: list[dict], template: str) -> list[dict]:
    """vLLM's: a template that does not name the developer role gets its messages as system
    ones, all system messages merged into the first."""
    if not any(m["role"] == "developer" for m in conv) or '"developer"' in template or "'developer'" in template:
        return conv
    conv = [{**m, "role": "system"} if m["role"] == "developer" else m for m in conv]
    systems = [i for i, m in enumerate(conv) if m["role"] == "system"]
    if systems == [0] or not systems:
        return conv
    merged = {"role": "system", "content": "\n\n".join(conv[i]["content"] for i in systems if conv[i]["content"])}
    return [merged, *(m for m in conv if m["role"] != "system")]


@lru_cache(maxsize=32)
def _template_vars(template: str) -> frozenset[str]:
    import jinja2.ext
    import jinja2.meta
    import jinja2.sandbox

    class _Generation(jinja2.ext.Extension):  # transformers' {% generation %} tag, so that such templates parse
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_noop"), [], [], body).set_lineno(lineno)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[_Generation, jinja2.ext.loopcontrols])
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))
    except jinja2.TemplateSyntaxError as exc:
        raise BadRequestError(f"the chat template does not parse: {exc}", param="chat_template") from None


def template_kwargs(tokenizer: Any, template: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """vLLM's resolve_chat_template_kwargs: a kwarg reaches the template only when the
    template reads it or apply_chat_template takes it."""
    params = set(inspect.signature(tokenizer.apply_chat_template).parameters)
    accept = (params | _template_vars(template)) - _OWN
    return {k: v for k, v in kwargs.items() if k in accept}


def render(tokenizer: Any, conv: list[dict], chat: ChatTemplate) -> str:
    template = template_of(tokenizer, chat)
    conv = developer_as_system(conv, template)
    extra = {"documents": chat.documents} if chat.documents is not None else {}
    try:
        return tokenizer.apply_chat_template(
            conv, tools=chat.tools, chat_template=template, add_generation_prompt=chat.add_generation_prompt,
            continue_final_message=chat.continue_final_message, tokenize=False,
            **extra, **template_kwargs(tokenizer, template, chat.kwargs))
    except BadRequestError:
        raise
    except Exception as exc:
        # vLLM: a template refusing the request (raise_exception, a bad kwarg) is a 400 with its reason.
        raise BadRequestError(_reason(exc), param="messages") from None


def _reason(exc: BaseException) -> str:
    import jinja2

    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, jinja2.TemplateError):
            return str(e)
        e = e.__cause__ or e.__context__
    return str(exc)
