"""Submitting jobs as chords and reading their state, without ever blocking on a result."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

from celery import Celery, chain, chord

from api.detok import Detokenizer
from api.schemas import ErrorBody, JobCreate, JobView
from api.streams import read_partial
from llmpipe import metrics
from llmpipe.admission import Admission, estimate_tokens
from llmpipe.cancel import request_cancel
from llmpipe.errors import LimitExceededError, NotFoundError, OverloadedError, UnavailableError
from llmpipe.jobs import JobRecord, JobStore
from llmpipe.messages import ErrorReason, JobResult, JobStatus, PromptRequest, SamplingParams
from llmpipe.settings import Settings

log = logging.getLogger("llmpipe.api")


class JobService:
    def __init__(self, celery: Celery, store: JobStore, settings: Settings, admission: Admission,
                 detok: Detokenizer | None = None, clock=time.time):
        self.celery = celery
        self.store = store
        self.settings = settings
        self.admission = admission
        self.detok = detok
        self._clock = clock
        # A chord of chains holds two producers of Celery's pool at once: the group takes
        # one and each chain's first task acquires another (celery/celery#5220). Once
        # broker_pool_limit / 2 submissions hold their first, all wait forever for a
        # second; measured with a 20 ms round trip to Redis at 64 concurrent POSTs
        # (docs/benchmarks.md, scaling). So at most that many submit at once.
        limit = celery.conf.broker_pool_limit
        self._submit_slots = threading.BoundedSemaphore(max(1, limit // 2)) if limit else None

    # -- submit ---------------------------------------------------------------------
    def check_limits(self, texts: list[str], n_prompts: int, max_tokens: int | None) -> None:
        s = self.settings
        if n_prompts > s.max_prompts_per_job:
            raise LimitExceededError(f"a job may hold at most {s.max_prompts_per_job} prompts (max_prompts_per_job); got {n_prompts}", param="prompts")
        if max_tokens is not None and max_tokens > s.max_tokens_limit:
            raise LimitExceededError(f"max_tokens may be at most {s.max_tokens_limit} (max_tokens_limit); got {max_tokens}", param="max_tokens")
        longest = max((len(t) for t in texts), default=0)
        if longest > s.max_prompt_chars:
            raise LimitExceededError(f"a prompt may be at most {s.max_prompt_chars} characters (max_prompt_chars); got {longest}", param="prompt")

    def submit(self, body: JobCreate) -> str:
        if body.messages is not None:
            inputs: list[dict[str, Any]] = [{"messages": body.messages}]
        elif body.prompts is not None:
            inputs = [{"prompt": p} for p in body.prompts]
        else:
            inputs = [{"prompt": body.prompt}]
        return self.submit_inputs(inputs, body.sampling(self.settings.default_max_tokens), timeout=body.timeout)

    def submit_inputs(self, inputs: list[dict[str, Any]], params: SamplingParams | list[SamplingParams], *,
                      timeout: float | None, stream: bool = False, kind: str = "job", meta: dict | None = None) -> str:
        """One chord for ``inputs`` (each a prompt or messages); ``params`` is shared or per input."""
        s = self.settings
        per_input = params if isinstance(params, list) else [params] * len(inputs)
        texts = [inp["prompt"] if "prompt" in inp else " ".join(m.content for m in inp["messages"]) for inp in inputs]
        max_tokens = max(p.max_tokens for p in per_input)
        self.check_limits(texts, len(inputs), max_tokens)
        now = self._clock()
        deadline = now + min(timeout or s.default_timeout_s, s.max_timeout_s)
        job_id = uuid.uuid4().hex
        decision = self.admission.try_admit(job_id, estimate_tokens(texts, max_tokens), deadline)
        if not decision.admitted:
            metrics.REJECTED.labels(decision.stage or "unknown").inc()
            what = "queued prompt tokens" if decision.stage == "tokens" else f"the {decision.stage} queue"
            raise OverloadedError(
                f"{what} is full ({decision.depth} of at most {decision.limit}); retry after {decision.retry_after_s:.0f}s",
                stage=decision.stage or "unknown", retry_after_s=decision.retry_after_s)
        msgs = [
            PromptRequest(job_id=job_id, index=i, deadline=deadline, enqueued_at=now, params=p, stream=stream, **inp)
            for i, (inp, p) in enumerate(zip(inputs, per_input, strict=True))
        ]
        self.store.create(job_id, n_prompts=len(msgs), deadline=deadline, kind=kind, meta=meta, now=now)
        header = [
            chain(
                self.celery.signature("llmpipe.preprocess", args=(m.model_dump(mode="json", exclude_defaults=True),)),
                self.celery.signature("llmpipe.inference"),
                self.celery.signature("llmpipe.postprocess"),
            )
            for m in msgs
        ]
        body_sig = self.celery.signature("llmpipe.collect", kwargs={"job_id": job_id, "submitted_at": now})
        try:
            if self._submit_slots is None:
                chord(header, body_sig).apply_async(task_id=job_id)
            else:
                with self._submit_slots:
                    chord(header, body_sig).apply_async(task_id=job_id)
        except Exception as exc:
            log.exception("job=%s stage=api could not enqueue", job_id)
            self.store.transition(job_id, JobStatus.FAILED, {"type": "unavailable", "message": "could not enqueue the job"})
            raise UnavailableError(f"could not enqueue the job: {type(exc).__name__}") from exc
        finally:
            self.admission.published(job_id)
        metrics.ADMITTED.inc()
        return job_id

    # -- read -----------------------------------------------------------------------
    def record(self, job_id: str) -> JobRecord:
        rec = self.store.get(job_id)
        if rec is None:
            raise NotFoundError(f"no job with id {job_id!r} (unknown or expired)", param="id")
        return rec

    def view(self, job_id: str, partial: bool = True) -> JobView:
        rec = self.record(job_id)
        view = JobView(id=job_id, status=rec.status, created_at=rec.created_at, deadline=rec.deadline, prompts=rec.n_prompts)
        meta = self.celery.backend.get_task_meta(job_id)
        state = meta.get("status")
        if rec.status in (JobStatus.CANCELLED, JobStatus.EXPIRED):
            # Settled outside the chord (DELETE, watchdog): that wins over what may still run.
            view.error = _error_from_record(rec)
        elif state == "SUCCESS":
            result = JobResult.model_validate(meta["result"])
            view.result, view.status = result, result.status
            if result.error:
                view.error = ErrorBody(type=result.error.reason, message=result.error.message, stage=result.error.stage)
        elif state == "FAILURE":
            view.status = JobStatus.FAILED
            view.error = ErrorBody(type=ErrorReason.INTERNAL, message=_failure_message(meta.get("result")))
        elif rec.status.terminal:
            view.error = _error_from_record(rec)
        elif partial and rec.status == JobStatus.RUNNING and self.detok is not None:
            ids = read_partial(self.store.r, job_id)
            if ids:
                view.partial = [self.detok.decode(ids.get(i, [])) for i in range(rec.n_prompts)]
        return view

    def cancel(self, job_id: str) -> JobView:
        rec = self.record(job_id)
        view = self.view(job_id, partial=False)
        if view.status.terminal:
            return view
        request_cancel(self.store.r, job_id, self.settings.result_ttl_s)
        self.store.transition(job_id, JobStatus.CANCELLED, {"type": "cancelled", "message": "cancelled by the client"})
        log.info("job=%s stage=api cancelled (was %s)", job_id, rec.status.value)
        return self.view(job_id, partial=False)


def _error_from_record(rec: JobRecord) -> ErrorBody | None:
    if not rec.error:
        return None
    t = rec.error.get("type")
    return ErrorBody(type=ErrorReason(t) if t in ErrorReason._value2member_map_ else ErrorReason.INTERNAL,
                     message=rec.error.get("message", ""))


def _failure_message(res: Any) -> str:
    if isinstance(res, dict):
        return f"{res.get('exc_type', 'error')}: {res.get('exc_message', '')}"
    return str(res)
