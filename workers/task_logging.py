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

from celery.signals import task_success

from llmpipe.observability.summaries import summarize  # noqa: F401 - also this module's API

SUMMARY_FORMAT = "Task %(name)s[%(id)s] succeeded in %(runtime)ss: %(summary)s"

_summaries: dict[str, str] = {}
_lock = threading.Lock()


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
