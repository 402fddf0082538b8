"""Submitting jobs as chords and reading their state, without ever blocking on a result."""

from __future__ import annotations

import time
import uuid
from typing import Any

from celery import Celery, chain, chord

from api.schemas import ErrorBody, JobCreate, JobView
from llmpipe.errors import LimitExceededError, NotFoundError, UnavailableError
from llmpipe.jobs import JobStore
from llmpipe.messages import ChatMessage, ErrorReason, JobResult, JobStatus, PromptRequest, SamplingParams
from llmpipe.settings import Settings


class JobService:
    def __init__(self, celery: Celery, store: JobStore, settings: Settings, clock=time.time):
        self.celery = celery
        self.store = store
        self.settings = settings
        self._clock = clock

    # -- submit ---------------------------------------------------------------------
    def check_limits(self, body: JobCreate) -> None:
        s = self.settings
        prompts = body.prompts or []
        if len(prompts) > s.max_prompts_per_job:
            raise LimitExceededError(f"a job may hold at most {s.max_prompts_per_job} prompts (max_prompts_per_job); got {len(prompts)}", param="prompts")
        if body.max_tokens is not None and body.max_tokens > s.max_tokens_limit:
            raise LimitExceededError(f"max_tokens may be at most {s.max_tokens_limit} (max_tokens_limit); got {body.max_tokens}", param="max_tokens")
        texts = prompts + ([body.prompt] if body.prompt else []) + [m.content for m in body.messages or []]
        longest = max((len(t) for t in texts), default=0)
        if longest > s.max_prompt_chars:
            raise LimitExceededError(f"a prompt may be at most {s.max_prompt_chars} characters (max_prompt_chars); got {longest}", param="prompt")

    def submit(self, body: JobCreate, *, kind: str = "job", meta: dict | None = None) -> str:
        self.check_limits(body)
        params = body.sampling(self.settings.default_max_tokens)
        inputs: list[dict[str, Any]]
        if body.messages is not None:
            inputs = [{"messages": body.messages}]
        elif body.prompts is not None:
            inputs = [{"prompt": p} for p in body.prompts]
        else:
            inputs = [{"prompt": body.prompt}]
        return self.submit_inputs(inputs, params, timeout=body.timeout, kind=kind, meta=meta)

    def submit_inputs(self, inputs: list[dict[str, Any]], params: SamplingParams, *, timeout: float | None,
                      kind: str = "job", meta: dict | None = None) -> str:
        s = self.settings
        now = self._clock()
        deadline = now + min(timeout or s.default_timeout_s, s.max_timeout_s)
        job_id = uuid.uuid4().hex
        msgs = [
            PromptRequest(job_id=job_id, index=i, deadline=deadline, enqueued_at=now, params=params, **inp)
            for i, inp in enumerate(inputs)
        ]
        self.store.create(job_id, n_prompts=len(msgs), deadline=deadline, kind=kind, meta=meta, now=now)
        header = [
            chain(
                self.celery.signature("llmpipe.preprocess", args=(m.model_dump(mode="json", exclude_none=True),)),
                self.celery.signature("llmpipe.inference"),
                self.celery.signature("llmpipe.postprocess"),
            )
            for m in msgs
        ]
        body_sig = self.celery.signature("llmpipe.collect", kwargs={"job_id": job_id, "submitted_at": now})
        try:
            chord(header, body_sig).apply_async(task_id=job_id)
        except Exception as exc:
            self.store.transition(job_id, JobStatus.FAILED, {"type": "unavailable", "message": "could not enqueue the job"})
            raise UnavailableError(f"could not enqueue the job: {exc}") from exc
        return job_id

    # -- read -----------------------------------------------------------------------
    def view(self, job_id: str) -> JobView:
        rec = self.store.get(job_id)
        if rec is None:
            raise NotFoundError(f"no job with id {job_id!r} (unknown or expired)", param="id")
        view = JobView(id=job_id, status=rec.status, created_at=rec.created_at, deadline=rec.deadline, prompts=rec.n_prompts)
        meta = self.celery.backend.get_task_meta(job_id)
        state = meta.get("status")
        if state == "SUCCESS":
            result = JobResult.model_validate(meta["result"])
            view.result, view.status = result, result.status
            if result.error:
                view.error = ErrorBody(type=result.error.reason, message=result.error.message, stage=result.error.stage)
        elif state == "FAILURE":
            view.status = JobStatus.FAILED
            view.error = ErrorBody(type=ErrorReason.INTERNAL, message=_failure_message(meta.get("result")))
        elif rec.status.terminal:
            if rec.error:
                view.error = ErrorBody(type=ErrorReason(rec.error.get("type", "internal_error")) if rec.error.get("type") in ErrorReason._value2member_map_ else ErrorReason.INTERNAL,
                                       message=rec.error.get("message", ""))
        return view


def _failure_message(res: Any) -> str:
    if isinstance(res, dict):
        return f"{res.get('exc_type', 'error')}: {res.get('exc_message', '')}"
    return str(res)
