"""Log probabilities in the shapes of vLLM's OpenAI server, from a prompt's result.

Postprocess gives, per position, the sampled (or prompt) token first and then the top ones,
each with its text (llmpipe.messages.Logprob). These functions lay them out exactly as
vLLM's ``serving_completion`` and ``serving_chat`` do, including their details: a
completion lists up to ``logprobs + 1`` entries per position (keyed by text, so two ids
with the same text make one key), a chat ``top_logprobs`` entries counted from the
sampled token, and -inf is written as -9999.0.
"""

from __future__ import annotations

from llmpipe.messages import Logprob

FLOOR = -9999.0


def _lp(e: Logprob) -> float | None:
    return None if e.logprob is None else max(e.logprob, FLOOR)


def _text(e: Logprob, as_ids: bool) -> str:
    return f"token_id:{e.id}" if as_ids else (e.token or "")


def _sampled(pos: list[Logprob], token_id: int) -> Logprob | None:
    return next((e for e in pos if e.id == token_id), None)


def completion_logprobs(token_ids: list[int], positions: list[list[Logprob]], k: int, *, as_ids: bool = False,
                        text_offset: int = 0) -> dict:
    """vLLM's CompletionLogProbs for ``token_ids`` (the prompt's too, with echo)."""
    offsets: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    tops: list[dict[str, float] | None] = []
    last_len = 0
    for i, (tid, pos) in enumerate(zip(token_ids, positions, strict=True)):
        e = _sampled(pos, tid)
        if e is None or e.logprob is None:  # the first prompt token: nothing precedes it
            tokens.append(f"token_id:{tid}" if as_ids else (e.token if e is not None else "") or "")
            token_logprobs.append(None)
            tops.append(None)
        else:
            tokens.append(_text(e, as_ids))
            token_logprobs.append(_lp(e))
            tops.append({_text(x, as_ids): _lp(x) for j, x in enumerate(pos) if k == -1 or k >= j})
        offsets.append(text_offset if i == 0 else offsets[-1] + last_len)
        last_len = len(tokens[-1])
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": tops}


def _bytes(text: str | None) -> list[int] | None:
    return None if text is None else list(text.encode("utf-8", errors="replace"))


def chat_logprobs(token_ids: list[int], positions: list[list[Logprob]], k: int, *, as_ids: bool = False) -> dict:
    """vLLM's ChatCompletionLogProbs: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for tid, pos in zip(token_ids, positions, strict=True):
        e = _sampled(pos, tid)
        if e is None:
            token = f"token_id:{tid}" if as_ids else ""
            content.append({"token": token, "logprob": FLOOR, "bytes": _bytes(token), "top_logprobs": []})
            continue
        top = [{"token": (t := _text(x, as_ids)), "logprob": _lp(x), "bytes": _bytes(t)}
               for j, x in enumerate(pos) if k == -1 or j < k]
        content.append({"token": _text(e, as_ids), "logprob": _lp(e), "bytes": _bytes(e.token), "top_logprobs": top})
    return {"content": content}


def prompt_logprobs_field(positions: list[list[Logprob]] | None) -> list[dict | None] | None:
    """vLLM's ``prompt_logprobs``: None for the first token, then {id: {logprob, rank, decoded_token}}."""
    if positions is None:
        return None
    out: list[dict | None] = []
    for pos in positions:
        if not pos or pos[0].logprob is None:
            out.append(None)
        else:
            out.append({str(e.id): {"logprob": _lp(e), "rank": e.rank, "decoded_token": e.token} for e in pos})
    return out
