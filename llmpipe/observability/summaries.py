"""Ids and sizes of a stage message, never its content: for logs, and for the argument
text (``argsrepr``) that each task message carries.

Celery puts ``saferepr(args)`` in every task message it sends. Task events (Flower) and
the worker's logs show it, so by default it would show the prompt text and its token ids.
It also costs: ``saferepr`` walks a 512-id prompt item by item, about 1 ms of CPU per sent
message on the development VM, on the hop from preprocess to inference where the floor
(``llmpipe bench --modes celery-floor``) sends one string. Each sender therefore passes a
summary instead (``llmpipe/broker/requeue.py``, ``api/jobs/service.py``), unless ``log_content`` asks for
the content.
"""

from __future__ import annotations

from typing import Any


def summarize(value: Any) -> str:
    """Ids and sizes of a stage's message or return value (a dict), without its content."""
    if not isinstance(value, dict):
        return f"{type(value).__name__}[{len(value)}]" if isinstance(value, list | tuple) else type(value).__name__
    parts = [f"{k}={value[k]}" for k in ("job_id", "index", "status") if value.get(k) is not None]
    for key, label in (("prompt_token_ids", "prompt_tokens"), ("output_token_ids", "output_tokens"),
                       ("token_ids", "output_tokens")):
        if isinstance(value.get(key), list):
            parts.append(f"{label}={len(value[key])}")
    for key in ("prompt", "text"):
        if isinstance(value.get(key), str):
            parts.append(f"{key}_chars={len(value[key])}")
    if isinstance(value.get("messages"), list):
        parts.append(f"messages={len(value['messages'])}")
    if isinstance(value.get("results"), list):
        parts.append(f"results={len(value['results'])}")
    if isinstance(value.get("usage"), dict):
        u = value["usage"]
        parts.append(f"tokens_in={u.get('prompt_tokens')} tokens_out={u.get('completion_tokens')}")
    if isinstance(value.get("error"), dict):
        parts.append(f"error={value['error'].get('reason')}")
    return " ".join(parts) or "dict"


def args_repr(args: Any) -> str:
    """What a task message shows of its positional arguments: a summary of each."""
    return "(" + ", ".join(summarize(a) for a in (args or ())) + ")"
