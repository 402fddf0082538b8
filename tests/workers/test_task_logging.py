"""A worker logs a finished task's ids, sizes and time, never its return value."""

import logging

from workers import task_logging


def _success_record(task_id: str, value: str) -> logging.LogRecord:
    # What celery.app.trace logs at INFO when a task succeeds.
    args = {"id": task_id, "name": "llmpipe.postprocess", "return_value": value, "runtime": 0.25, "args": "", "kwargs": ""}
    rec = logging.LogRecord("celery.app.trace", logging.INFO, __file__, 1,
                            "Task %(name)s[%(id)s] succeeded in %(runtime)ss: %(return_value)s", (args,), None)
    rec.args = args
    return rec


def test_summary_has_ids_and_sizes_but_no_content():
    result = {"job_id": "j1", "index": 2, "text": "Bonjour, secret", "token_ids": [5, 6, 7],
              "prompt_token_ids": [1, 2], "error": None}
    s = task_logging.summarize(result)
    assert s == "job_id=j1 index=2 prompt_tokens=2 output_tokens=3 text_chars=15"
    assert "secret" not in s and "5, 6" not in s
    job = {"job_id": "j1", "status": "succeeded", "results": [result], "usage": {"prompt_tokens": 2, "completion_tokens": 3}}
    assert task_logging.summarize(job) == "job_id=j1 status=succeeded results=1 tokens_in=2 tokens_out=3"


def test_the_success_line_carries_the_summary_instead_of_the_value():
    class Task:
        class request:
            id = "t-1"

    logging.getLogger("celery.app.trace").setLevel(logging.INFO)
    task_logging._remember(sender=Task, result={"job_id": "j9", "index": 0, "text": "the secret answer"})
    rec = _success_record("t-1", "{'text': 'the secret answer'}")
    assert task_logging.HideTaskResults().filter(rec)
    line = rec.getMessage()
    assert line == "Task llmpipe.postprocess[t-1] succeeded in 0.25s: job_id=j9 index=0 text_chars=17"
    assert "secret" not in line and not task_logging._summaries  # taken back out: nothing piles up


def test_a_value_without_a_summary_is_still_hidden():
    rec = _success_record("t-unknown", "{'text': 'secret'}")
    task_logging.HideTaskResults().filter(rec)
    assert "secret" not in rec.getMessage()
