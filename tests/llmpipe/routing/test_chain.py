"""Redirecting a chain's next stage from inside the running task (llmpipe/routing/chain.py)."""

from __future__ import annotations

from types import SimpleNamespace

from celery import chain

from llmpipe.celery_app import app
from llmpipe.routing.chain import next_stage_to


def _request(*names: str, **options):
    """A running task's request holding the rest of a chain, as Celery hands it over."""
    sigs = chain(*(app.signature(n, options=dict(options)) for n in names))
    # the task that runs now is the first; Celery keeps the rest reversed (the next last)
    return SimpleNamespace(chain=[dict(s) for s in reversed(sigs.tasks[1:])])


def test_the_next_inference_signature_goes_to_the_queue_given():
    req = _request("llmpipe.preprocess", "llmpipe.inference", "llmpipe.postprocess", queue="inference", priority=3)
    assert next_stage_to(req, "inference~w@h")
    nxt = req.chain[-1]
    assert nxt["task"] == "llmpipe.inference" and nxt["options"]["queue"] == "inference~w@h"
    assert nxt["options"]["priority"] == 3 and req.chain[0]["options"]["queue"] == "inference"


def test_only_an_inference_hop_is_redirected():
    req = _request("llmpipe.inference", "llmpipe.postprocess", queue="postprocess")
    assert not next_stage_to(req, "inference~w@h") and req.chain[-1]["options"]["queue"] == "postprocess"
    assert not next_stage_to(SimpleNamespace(chain=None), "inference~w@h")
