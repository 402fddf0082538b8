"""Stage messages are shown by ids and sizes (llmpipe/observability/summaries.py), also in the task
messages that the workers send (llmpipe/broker/requeue.py)."""

from __future__ import annotations

import pytest
from celery import Celery
from celery.signals import before_task_publish

from llmpipe.observability.summaries import args_repr, summarize


def test_a_tokenized_request_is_shown_by_its_ids_and_sizes():
    msg = {"job_id": "j1", "index": 0, "prompt_token_ids": list(range(512)), "params": {"max_tokens": 8}}
    assert args_repr((msg,)) == "(job_id=j1 index=0 prompt_tokens=512)"
    assert args_repr(([msg, msg],)) == "(list[2])"
    assert args_repr(()) == "()" and args_repr(None) == "()"


def test_a_chat_request_shows_no_message_content():
    s = summarize({"job_id": "j2", "index": 1, "messages": [{"role": "user", "content": "my password"}]})
    assert s == "job_id=j2 index=1 messages=1"


@pytest.fixture
def published():
    seen: list[dict] = []

    def grab(sender=None, headers=None, **_):
        seen.append(headers)

    before_task_publish.connect(grab, weak=False)
    yield seen
    before_task_publish.disconnect(grab)


def _stage(app):
    @app.task(name="t.stage", shared=False)
    def stage(msg):
        return msg

    return stage


@pytest.mark.parametrize("log_content", [False, True])
def test_a_worker_sent_message_carries_the_summary_unless_log_content(published, monkeypatch, log_content):
    from llmpipe.broker import requeue

    monkeypatch.setattr(requeue, "get_settings", lambda: type("S", (), {"log_content": log_content})())
    app = Celery("t", broker="memory://", task_cls="llmpipe.broker.requeue:RequeueTask")
    msg = {"job_id": "j3", "index": 0, "prompt_token_ids": [101, 102, 103]}
    _stage(app).apply_async((msg,))
    [headers] = published
    if log_content:
        assert "101, 102, 103" in headers["argsrepr"]  # Celery's saferepr, content and all
    else:
        assert headers["argsrepr"] == "(job_id=j3 index=0 prompt_tokens=3)"


def test_an_argsrepr_given_by_the_sender_is_kept(published):
    app = Celery("t", broker="memory://", task_cls="llmpipe.broker.requeue:RequeueTask")
    _stage(app).apply_async(({"job_id": "j4"},), argsrepr="(given)")
    assert published[0]["argsrepr"] == "(given)"


def test_a_task_success_shows_no_content_in_its_event():
    """What Celery puts in the task-succeeded event (Flower) of a stage: not the generated text."""
    from celery.app.trace import build_tracer

    app = Celery("t", broker="memory://", task_cls="llmpipe.broker.requeue:RequeueTask")

    @app.task(name="t.post", shared=False, ignore_result=True)
    def post(msg):
        return {"index": 0, "text": "the secret answer", "token_ids": list(range(64))}

    trace = build_tracer(post.name, post, app=app, eager=False, propagate=False)
    retval, _, _, shown = trace("id-1", ({"job_id": "j5"},), {}, {"delivery_info": {}})
    assert retval["text"] == "the secret answer"
    assert "secret" not in shown and "17" not in shown, shown
