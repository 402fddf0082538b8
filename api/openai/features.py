"""vLLM's request fields beyond plain sampling (token-id prompts, logprobs, echo, guided
decoding, tools): what the API checks before it enqueues, and how a finished prompt
becomes a choice. The pipeline carries them as data: preprocess skips tokenizing token-id
prompts and renders tools, inference asks the engine for logprobs or a grammar,
postprocess names the tokens and parses tool calls and reasoning; here they only take
vLLM's shapes."""

from __future__ import annotations

from api.openai.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs_field
from api.openai.protocol import ChatCompletionRequest, CompletionRequest
from llmpipe.engines.base import refusal
from llmpipe.engines.kinds import engine_class
from llmpipe.errors import BadRequestError
from llmpipe.messages import PromptResult, SamplingParams
from llmpipe.settings import Settings


def check_request(req: CompletionRequest | ChatCompletionRequest, s: Settings, params: SamplingParams) -> None:
    """Refuse, with a 400 naming the field, what this server cannot do as asked; ``params``:
    the request's sampling parameters (its first choice's, which vLLM's checks already made)."""
    if isinstance(req, ChatCompletionRequest):
        req.check_chat(s, req.model)
    _check_engine(req, s, params)
    for name, n in (("logprobs", req.sample_logprobs()), ("prompt_logprobs", req.prompt_logprobs)):
        if n is not None and s.max_logprobs != -1 and (n == -1 or n > s.max_logprobs):
            kind = "sample" if name == "logprobs" else "prompt"
            raise BadRequestError(f"Requested {kind} logprobs of {n}, which is greater than max allowed: "
                                  f"{s.max_logprobs}", param=name)
    if req.stream and req.sample_logprobs() is not None:
        raise BadRequestError("llmpipe does not stream log probabilities: ask without `stream`", param="logprobs")
    if req.stream and req.return_token_ids:
        raise BadRequestError("llmpipe does not stream token ids: ask without `stream`", param="return_token_ids")


def _check_engine(req: CompletionRequest | ChatCompletionRequest, s: Settings, params: SamplingParams) -> None:
    """What the engine class declares it cannot do (llmpipe/engines/base.py refusal)."""
    engine = engine_class(s.engine, s.sim_continuous)
    refused = refusal(engine, params)
    if refused is None and isinstance(req, ChatCompletionRequest) and req.tool_choice_value() not in (None, "none", "auto") \
            and not engine.supports_structured_outputs:
        refused = "tool_choice", (f"tool_choice {req.tool_choice_value()!r} constrains the output to a tool call "
                                  f"with guided decoding, which the {engine.name} engine does not have")
    if refused is not None:
        field, message = refused
        raise BadRequestError(message, param=structured_param(req) if field == "structured" else field)


def structured_param(req: CompletionRequest | ChatCompletionRequest) -> str:
    """The request field that asked for a constraint."""
    for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if getattr(req, name) is not None:
            return name
    return "response_format"


def completion_choice(r: PromptResult, req: CompletionRequest, inp: dict) -> dict:
    """One choice of vLLM's completion response; ``inp`` is the job input of this prompt."""
    as_ids = bool(req.return_tokens_as_token_ids)
    text, ids, positions = r.text, r.token_ids, r.logprobs
    if req.echo:
        prompt_text = echo_text(inp, r.prompt_text)
        prompt_ids = r.prompt_token_ids or []
        prompt_positions = r.prompt_logprobs or [[] for _ in prompt_ids]
        if req.echo_only():
            text, ids, positions = prompt_text, prompt_ids, prompt_positions if positions is not None else None
        else:
            text = prompt_text + r.text
            ids = [*prompt_ids, *r.token_ids]
            if positions is not None:
                positions = [*prompt_positions, *positions]
    return {
        "index": r.index, "text": text, "finish_reason": r.finish_reason.value, "stop_reason": r.stop_reason,
        "logprobs": None if positions is None else completion_logprobs(ids, positions, req.logprobs, as_ids=as_ids),
        "token_ids": r.token_ids if req.return_token_ids else None,
        "prompt_logprobs": prompt_logprobs_field(r.prompt_logprobs),
        "prompt_token_ids": r.prompt_token_ids if req.return_token_ids else None,
    }


def echo_text(inp: dict, decoded: str | None) -> str:
    """The prompt as vLLM echoes it: the text as sent, or a token-id prompt decoded with its
    special tokens."""
    return inp["prompt"] if "prompt" in inp else (decoded or "")


def chat_choice(r: PromptResult, req: ChatCompletionRequest) -> dict:
    as_ids = bool(req.return_tokens_as_token_ids)
    # vLLM leaves the logprobs and ids out when the reasoning is hidden (they would show it).
    hide = r.parsed is not None and not req.include_reasoning
    finish = "tool_calls" if r.parsed is not None and r.parsed.tools_called else r.finish_reason.value
    message = chat_message(r, req)
    if req.legacy_functions and finish == "tool_calls":
        finish = "function_call"
    return {
        "index": r.index, "message": message, "finish_reason": finish, "stop_reason": r.stop_reason,
        "logprobs": None if r.logprobs is None or hide else chat_logprobs(r.token_ids, r.logprobs,
                                                                           req.top_logprobs or 0, as_ids=as_ids),
        "token_ids": r.token_ids if req.return_token_ids and not hide else None,
    }


def stream_finish(r: PromptResult, req: ChatCompletionRequest, calls_streamed: bool) -> str:
    """A stream's last finish_reason, vLLM's rule: "tool_calls" when calls were streamed, the
    choice named no function and the engine stopped (an answer's rule differs: chat_choice)."""
    named = isinstance(req.tool_choice_value(), dict)
    if calls_streamed and not named and r.finish_reason.value == "stop":
        return "tool_calls"
    return r.finish_reason.value


def chat_message(r: PromptResult, req: ChatCompletionRequest) -> dict:
    """The answer's message as vLLM's chat server builds it: the parsers' content, reasoning and
    tool calls when the model has parsers (postprocess split them), else the text; with
    OpenAI's older functions, the first call as ``function_call``."""
    msg: dict = {"role": req.response_role(), "content": r.text, "reasoning": None}
    if r.parsed is not None:
        p = r.parsed
        msg.update(content=p.content, reasoning=p.reasoning if req.include_reasoning else None)
        calls = [c.model_dump() for c in p.tool_calls]
        if calls and req.legacy_functions:
            msg["function_call"] = calls[0]["function"]
        elif calls:
            msg["tool_calls"] = calls
    if req.echo_text():
        msg["content"] = req.echo_text() + (msg["content"] or "")
    return msg


def chat_extras(results: list[PromptResult], req: ChatCompletionRequest) -> dict:
    """The response-level fields vLLM adds to a chat answer."""
    first = results[0] if results else None
    return {
        "prompt_logprobs": prompt_logprobs_field(first.prompt_logprobs) if first else None,
        "prompt_token_ids": first.prompt_token_ids if first is not None and req.return_token_ids else None,
    }
