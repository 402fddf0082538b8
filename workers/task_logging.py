"""What a worker logs about a finished task: ids, sizes and the time, never its content.

Celery logs every success at INFO as "Task NAME[ID] succeeded in Ts: <return value>", and
a stage's return value holds the prompt's token ids, the generated text and the whole
result. A filter on Celery's ``celery.app.trace`` logger swaps the value for a summary
(job id, prompt index, token counts, bytes of text) taken from the result by a
``task_success`` handler, which Celery runs just before it logs, in the same thread.
``LLMPIPE_LOG_CONTENT=true`` keeps Celery's own line, value included, for debugging.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery.signals import task_success

SUMMARY_FORMAT = "Task %(name)s[%(id)s] succeeded in %(runtime)ss: %(summary)s"

_summaries: dict[str, str] = {}
_lock = threading.Lock()


def summarize(result: Any) -> str:
    """Ids and sizes of a stage's return value (a message dict), without its content."""
    if not isinstance(result, dict):
        return type(result).__name__
    parts = [f"{k}={result[k]}" for k in ("job_id", "index", "status") if result.get(k) is not None]
    for key, label in (("prompt_token_ids", "prompt_tokens"), ("output_token_ids", "output_tokens"),
                       ("token_ids", "output_tokens")):
        if isinstance(result.get(key), list):
            parts.append(f"{label}={len(result[key])}")
    if isinstance(result.get("text"), str):
        parts.append(f"text_chars={len(result['text'])}")
    if isinstance(result.get("results"), list):
        parts.append(f"results={len(result['results'])}")
    if isinstance(result.get("usage"), dict):
        u = result["usage"]
        parts.append(f"tokens_in={u.get('prompt_tokens')} tokens_out={u.get('completion_tokens')}")
    if isinstance(result.get("error"), dict):
        parts.append(f"error={result['error'].get('reason')}")
    return " ".join(parts) or "dict"


_trace_log = logging.getLogger("celery.app.trace")


def _remember(sender=None, result=None, **_) -> None:
    # Only when Celery will log the success line (which takes the summary back out).
    task_id = getattr(getattr(sender, "request", None), "id", None)
    if task_id and _trace_log.isEnabledFor(logging.INFO):
        with _lock:
            _summaries[task_id] = summarize(result)


class HideTaskResults(logging.Filter):
    """Rewrites Celery's success line to carry the summary instead of the return value."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, dict) and "return_value" in args:
            with _lock:
                summary = _summaries.pop(str(args.get("id")), "")
            record.msg = SUMMARY_FORMAT
            record.args = {**args, "return_value": "<hidden>", "summary": summary or "<hidden>"}
            if hasattr(record, "data"):  # Celery passes the same values to custom handlers
                record.data = record.args
        return True


_installed: list[HideTaskResults] = []


def install(log_content: bool) -> None:
    """Hide task results from the logs unless ``log_content``; idempotent."""
    if log_content or _installed:
        return
    f = HideTaskResults()
    _trace_log.addFilter(f)
    task_success.connect(_remember, weak=False)
    _installed.append(f)
