"""The request kinds a load point sends: the job API, or one of four OpenAI kinds.

``completions-stream``, ``completions``, ``chat-stream`` and ``chat``: ``POST
/v1/completions`` or ``POST /v1/chat/completions``, with ``stream: true`` (server-sent
events, with a TTFT) or without (one JSON answer, no TTFT). ``jobs``: ``POST /v1/jobs`` and
``GET ?wait=`` (the pipeline, the serial server and the celery floor).
"""

from __future__ import annotations

JOBS = "jobs"
KINDS = ("completions-stream", "completions", "chat-stream", "chat")
STREAMING = frozenset(k for k in KINDS if k.endswith("-stream"))


def endpoint(kind: str) -> str:
    """What a server must have for ``kind``: ``jobs``, ``completions`` or ``chat``."""
    if kind == JOBS:
        return JOBS
    if kind not in KINDS:
        raise ValueError(f"unknown request kind {kind!r}; choose from {', '.join(KINDS)}")
    return "chat" if kind.startswith("chat") else "completions"
