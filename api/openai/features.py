"""vLLM's request fields beyond plain sampling (token-id prompts, logprobs, echo,
response_format): what the API checks before it enqueues, and how a finished prompt
becomes a choice. The pipeline carries them as data: preprocess skips tokenizing token-id
prompts, inference asks the engine for logprobs or a grammar, postprocess names the
tokens; here they only take vLLM's shapes."""

from __future__ import annotations

from api.openai.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs_field
from api.openai.protocol import ChatCompletionRequest, CompletionRequest
from llmpipe.errors import BadRequestError
from llmpipe.messages import PromptResult
from llmpipe.settings import EngineKind, Settings

# What each engine does beyond plain sampling (the API never imports an engine).
_LOGPROBS = {EngineKind.VLLM, EngineKind.TRANSFORMERS}
_STRUCTURED = {EngineKind.VLLM}


def check_request(req: CompletionRequest | ChatCompletionRequest, s: Settings) -> None:
    """Refuse, with a 400 naming the field, what this server cannot do as asked."""
    engine = EngineKind(s.engine)
    for name, n in (("logprobs", req.sample_logprobs()), ("prompt_logprobs", req.prompt_logprobs)):
        if n is None:
            continue
        if engine not in _LOGPROBS:
            raise BadRequestError(f"the {engine.value} engine does not return log probabilities", param=name)
        if s.max_logprobs != -1 and (n == -1 or n > s.max_logprobs):
            kind = "sample" if name == "logprobs" else "prompt"
            raise BadRequestError(f"Requested {kind} logprobs of {n}, which is greater than max allowed: "
                                  f"{s.max_logprobs}", param=name)
    if req.stream and req.sample_logprobs() is not None:
        raise BadRequestError("llmpipe does not stream log probabilities: ask without `stream`", param="logprobs")
    if req.stream and req.return_token_ids:
        raise BadRequestError("llmpipe does not stream token ids: ask without `stream`", param="return_token_ids")
    if req.response_format is not None and req.response_format.structured() is not None and engine not in _STRUCTURED:
        raise BadRequestError(f"response_format {req.response_format.type!r} needs structured outputs, which the "
                              f"{engine.value} engine does not have (run the vllm engine)", param="response_format")


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
    return {
        "index": r.index, "message": {"role": "assistant", "content": r.text},
        "finish_reason": r.finish_reason.value, "stop_reason": r.stop_reason,
        "logprobs": None if r.logprobs is None else chat_logprobs(r.token_ids, r.logprobs, req.top_logprobs or 0,
                                                                   as_ids=as_ids),
        "token_ids": r.token_ids if req.return_token_ids else None,
    }


def chat_extras(results: list[PromptResult], req: ChatCompletionRequest) -> dict:
    """The response-level fields vLLM adds to a chat answer."""
    first = results[0] if results else None
    return {
        "prompt_logprobs": prompt_logprobs_field(first.prompt_logprobs) if first else None,
        "prompt_token_ids": first.prompt_token_ids if first is not None and req.return_token_ids else None,
    }
