"""Submitting jobs as chords and reading their state from the job record, never blocking on a result."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from celery import Celery, chain
from celery import chord as celery_chord
from celery.canvas import Signature
from starlette.concurrency import run_in_threadpool

from api.aio import within
from api.detok import Detokenizers
from api.errors import ErrorBody
from api.jobs.protocol import JobCreate, JobView
from api.request_keys import RequestKey, RequestKeys
from api.waiter import JobWaiter
from llmpipe.broker.redis_clients import UNAVAILABLE_ERRORS
from llmpipe.engines.base import refusal
from llmpipe.engines.kinds import engine_class
from llmpipe.errors import BadRequestError, LimitExceededError, NotFoundError, OverloadedError, UnavailableError
from llmpipe.jobs.admission import Admission, estimate_tokens, release
from llmpipe.jobs.lanes import Lane, broker_priority, lane_for
from llmpipe.jobs.store import JobRecord, JobStore, parse_wake
from llmpipe.jobs.streaming import read_published
from llmpipe.messages import ErrorReason, JobStatus, PromptRequest, SamplingParams
from llmpipe.models.served import ServedModel
from llmpipe.observability import metrics
from llmpipe.observability.summaries import args_repr
from llmpipe.settings import Settings
from llmpipe.stages import COLLECT_TASK, Stage

log = logging.getLogger("llmpipe.api")


@dataclass(frozen=True)
class Submitted:
    job_id: str
    deadline: float
    replayed: bool = False  # an Idempotency-Key mapped this request to a job made earlier


@dataclass
class _Job:
    """A job while it is submitted: what each step needs, and how far it got (for ``_undo``)."""

    id: str
    now: float
    deadline: float
    lane: Lane
    model: ServedModel
    key: RequestKey | None
    admitted: bool = False
    created: bool = False


class JobService:
    def __init__(self, celery: Celery, store: JobStore, settings: Settings, admission: Admission,
                 detok: Detokenizers | None = None, clock=time.time, keys: RequestKeys | None = None):
        self.celery = celery
        self.store = store
        self.settings = settings
        self.admission = admission
        self.detok = detok
        self.models = settings.served  # llmpipe/models/served.py: what a request's ``model`` may name
        self._clock = clock
        self.keys = keys or RequestKeys(store.r, ttl_s=settings.result_ttl_s)
        # A chord of chains holds two producers of Celery's pool at once: the group takes
        # one and each chain's first task acquires another (celery/celery#5220). Once
        # broker_pool_limit / 2 submissions hold their first, all wait forever for a
        # second; measured with a 20 ms round trip to Redis at 64 concurrent POSTs
        # (docs/benchmarks.md, scaling). So at most that many submit at once.
        limit = celery.conf.broker_pool_limit
        self._submit_slots = threading.BoundedSemaphore(max(1, limit // 2)) if limit else None
        # Size Celery's (process-global) pools now, in one thread: done lazily by the first
        # submissions, it races with them ("Can't shrink pool when in use").
        celery.pool  # noqa: B018

    # -- submit ---------------------------------------------------------------------
    def _preprocess_signature(self, m: PromptRequest, options: dict) -> Signature:
        body = m.model_dump(mode="json", exclude_defaults=True)
        # Ids and sizes in the message, not the prompt (llmpipe/observability/summaries.py); None: Celery's
        # own repr (log_content). Always given: where the tasks are registered too (a test
        # process), the task class would otherwise fill in its own choice (llmpipe/broker/requeue.py).
        options = {**options, "argsrepr": None if self.settings.log_content else args_repr((body,))}
        return self.celery.signature(Stage.PREPROCESS.task, args=(body,), options=options)

    def check_limits(self, texts: list[str], n_prompts: int, max_tokens: int | None) -> None:
        s = self.settings
        if n_prompts > s.max_prompts_per_job:
            raise LimitExceededError(f"a job may hold at most {s.max_prompts_per_job} prompts (max_prompts_per_job); got {n_prompts}", param="prompts")
        if max_tokens is not None and max_tokens > s.max_tokens_limit:
            raise LimitExceededError(f"max_tokens may be at most {s.max_tokens_limit} (max_tokens_limit); got {max_tokens}", param="max_tokens")
        longest = max((len(t) for t in texts), default=0)
        if longest > s.max_prompt_chars:
            raise LimitExceededError(f"a prompt may be at most {s.max_prompt_chars} characters (max_prompt_chars); got {longest}", param="prompt")

    def submit(self, body: JobCreate, key: RequestKey | None = None) -> Submitted:
        params = body.sampling(self.settings.default_max_tokens)
        refused = refusal(engine_class(self.settings.engine, self.settings.sim_continuous), params)
        if refused is not None:
            raise BadRequestError(refused[1], param=refused[0])
        if body.messages is not None:
            body.check_chat(self.settings, body.model)
            inputs: list[dict[str, Any]] = [{"messages": body.messages, "parsing": body.output_parsing(),
                                             "chat": body.chat_template_options(self.settings.trust_request_chat_template)}]
        elif body.prompts is not None:
            inputs = [{"prompt": p} for p in body.prompts]
        else:
            inputs = [{"prompt": body.prompt}]
        return self.submit_inputs(inputs, params, timeout=body.timeout, key=key, priority=body.priority, model=body.model)

    def submit_inputs(self, inputs: list[dict[str, Any]], params: SamplingParams | list[SamplingParams], *,
                      timeout: float | None, stream: bool = False, kind: str = "job", meta: dict | None = None,
                      key: RequestKey | None = None, waiting: bool = False, choices: int = 1,
                      priority: int = 0, model: str | None = None, job_id: str | None = None) -> Submitted:
        """One chord for ``inputs`` (each a prompt or messages); ``params`` is shared or per input.

        ``key``: the request's Idempotency-Key; a job it already names is returned instead
        of a new one. ``waiting``: the caller waits on the job over HTTP and counts as one of
        its waiters (the job is cancelled when every waiter has disconnected). ``choices``: each
        prompt is in ``inputs`` this many times (OpenAI's ``n``, limited by max_n on its own).
        ``priority``: vLLM's (lower is sooner); it picks the job's lane (llmpipe/jobs/lanes.py).
        ``model``: a served model's name (None: the default); its inference queue runs the job,
        and one not served is ModelNotFoundError (404) before anything is admitted. ``job_id``:
        the job's id (None: a new one); a caller that names it makes it unique with ``key``
        (the Batch API: one id per batch line and run)."""
        s = self.settings
        served = self.models.get(model)
        lane = lane_for(priority, s.lane_batch_priority)
        per_input = params if isinstance(params, list) else [params] * len(inputs)
        texts = [_input_text(inp) for inp in inputs]
        max_tokens = max(p.max_tokens for p in per_input)
        self.check_limits([t for inp in inputs for t in _input_pieces(inp)], len(inputs) // choices, max_tokens)
        inputs = [{k: v for k, v in inp.items() if k != "limit_pieces"} for inp in inputs]
        now = self._clock()
        job = _Job(uuid.uuid4().hex if job_id is None else job_id, now,
                   now + min(timeout or s.default_timeout_s, s.max_timeout_s), lane, served, key)
        if key is not None:
            claim = self.keys.claim(key, job.id, attach=waiting)
            if claim.existing:
                log.info("job=%s stage=api replayed for Idempotency-Key", claim.job_id)
                return Submitted(claim.job_id, claim.deadline or job.deadline, replayed=True)
        try:
            given_ids = sum(len(inp.get("prompt_token_ids") or ()) for inp in inputs)  # token-id prompts: their length
            self._admit(job, estimate_tokens(texts, max_tokens) + given_ids)
            msgs = [
                PromptRequest(job_id=job.id, index=i, deadline=job.deadline, enqueued_at=now, params=p, stream=stream,
                              priority=priority, model=served.name, **inp)
                for i, (inp, p) in enumerate(zip(inputs, per_input, strict=True))
            ]
            self._create(job, len(msgs), kind=kind, meta=meta, waiting=waiting, stream=stream)
            self._publish(job, msgs)
        except Exception as exc:
            self._undo(job.id, key, admitted=job.admitted, created=job.created)
            if isinstance(exc, OverloadedError):
                raise
            log.warning("job=%s stage=api could not enqueue: %s: %s", job.id, type(exc).__name__, exc)
            raise UnavailableError(f"could not enqueue the job: {type(exc).__name__}") from exc
        finally:
            if job.admitted:
                self._published(job.id)
        metrics.ADMITTED.inc()
        return Submitted(job.id, job.deadline)

    def _admit(self, job: _Job, tokens: int) -> None:
        """Reserve the job's place in its lane and queues, or OverloadedError (429)."""
        decision = self.admission.try_admit(job.id, tokens, job.deadline, lane=job.lane, inference_queue=job.model.queue)
        if not decision.admitted:
            metrics.REJECTED.labels(decision.stage or "unknown").inc()
            what = "queued prompt tokens" if decision.stage == "tokens" else f"the {decision.stage} queue"
            raise OverloadedError(
                f"{what} is full for the {job.lane.value} lane ({decision.depth} of at most {decision.limit}); "
                f"retry after {decision.retry_after_s:.0f}s",
                stage=decision.stage or "unknown", retry_after_s=decision.retry_after_s)
        job.admitted = True

    def _create(self, job: _Job, n_prompts: int, *, kind: str, meta: dict | None, waiting: bool, stream: bool) -> None:
        """The job record, and the Idempotency-Key's claim kept as long as it, in one round trip."""
        pipe = self.store.r.pipeline(transaction=False)
        self.store.create(job.id, n_prompts=n_prompts, deadline=job.deadline, kind=kind,
                          meta={**(meta or {}), "model": job.model.name}, now=job.now,
                          pipe=pipe, waiters=1 if waiting else 0, stream=stream)
        if job.key is not None:
            self.keys.keep(pipe, job.key)
        pipe.execute()
        job.created = True

    def _publish(self, job: _Job, msgs: list[PromptRequest]) -> None:
        """Send the job's chord: each prompt's chain of stages, then collect."""
        # Every stage's message carries the lane's broker priority: on Redis each queue is
        # one list per priority step, claimed interactive first (celeryconfig.py).
        pri = {"priority": broker_priority(job.lane, amqp=self.settings.broker_is_amqp)}
        header = [
            chain(
                self._preprocess_signature(m, pri),
                # The model's own inference queue (inference.<name> with several models).
                self.celery.signature(Stage.INFERENCE.task, options={**pri, "queue": job.model.queue}),
                self.celery.signature(Stage.POSTPROCESS.task, options=pri),
            )
            for m in msgs
        ]
        collect = self.celery.signature(COLLECT_TASK, kwargs={"job_id": job.id, "submitted_at": job.now,
                                                             "model": job.model.name}, options=pri)
        if self._submit_slots is None:
            chord(header, collect).apply_async(task_id=job.id)
        else:
            with self._submit_slots:
                chord(header, collect).apply_async(task_id=job.id)

    def _published(self, job_id: str) -> None:
        """The job's messages are out (or never will be): its pending admission mark goes."""
        try:
            self.admission.published(job_id)
        except Exception:  # the pending mark expires after 10 s by itself
            log.warning("job=%s stage=api could not clear its pending admission", job_id)

    def _undo(self, job_id: str, key: RequestKey | None, *, admitted: bool, created: bool) -> None:
        """A job that was not enqueued: its reservation, its key and its record go, each
        best effort (Redis may be what failed; the reservation then ends at its deadline)."""
        steps = []
        if created:
            steps.append(lambda: self.store.transition(
                job_id, JobStatus.FAILED, {"type": ErrorReason.UNAVAILABLE.value, "message": "could not enqueue the job"}))
        if admitted:
            steps.append(lambda: release(self.store.r, job_id, drained=False))
        if key is not None:
            steps.append(lambda: self.keys.release(key, job_id))
        for step in steps:
            try:
                step()
            except Exception as exc:
                log.warning("job=%s stage=api cleanup after a failed submit failed: %s", job_id, exc)

    # -- read -----------------------------------------------------------------------
    def record(self, job_id: str) -> JobRecord:
        rec = self.store.get(job_id)
        if rec is None:
            raise NotFoundError(f"no job with id {job_id!r} (unknown or expired)", param="id")
        return rec

    def view(self, job_id: str, partial: bool = True) -> JobView:
        """The job as its record says: one HGETALL (and the token stream while it runs)."""
        return self.view_of(self.record(job_id), partial)

    def view_of(self, rec: JobRecord, partial: bool = True) -> JobView:
        """The view of a record read already (reads the token stream only while it runs)."""
        job_id = rec.job_id
        view = JobView(id=job_id, status=rec.status, created_at=rec.created_at, deadline=rec.deadline,
                       prompts=rec.n_prompts, result=rec.result, error=_error_from_record(rec))
        if partial and rec.status == JobStatus.RUNNING and self.detok is not None:
            ids = read_published(self.store.r, job_id)
            if ids:
                detok = self.detok.get(_model_of(rec, self.models))
                view.partial = [detok.decode(ids.get(i, [])) for i in range(rec.n_prompts)]
        return view

    # -- settle ---------------------------------------------------------------------
    def cancel(self, job_id: str) -> JobView:
        """DELETE: queued work never runs, running engine requests are aborted. A job that
        already ended is returned unchanged (its terminal state never changes)."""
        rec = self.record(job_id)
        if not rec.status.terminal and self.store.stop(
                job_id, JobStatus.CANCELLED, {"type": ErrorReason.CANCELLED.value, "message": "cancelled by the client"}):
            log.info("job=%s stage=api cancelled (was %s)", job_id, rec.status.value)
        return self.view(job_id, partial=False)

    def delete(self, job_id: str) -> JobView:
        """Cancelled first if it has not ended (as :meth:`cancel`), then forgotten: a later
        read is 404. Answers the job as it was last."""
        view = self.cancel(job_id)
        self.store.delete(job_id)
        return view

    def expire(self, job_id: str, message: str) -> None:
        """The API stopped waiting at the deadline: the job ends ``expired`` (unless it just ended)."""
        self.store.stop(job_id, JobStatus.EXPIRED, {"type": ErrorReason.EXPIRED.value, "message": message})

    def abandon(self, job_id: str) -> None:
        """A waiting client disconnected: the job is cancelled once no client waits on it."""
        if self.store.abandon(job_id) == 1:
            log.info("job=%s stage=api cancelled: its client disconnected", job_id)


async def wait_view(service: JobService, waiter: JobWaiter, job_id: str, wait: float, *,
                    partial: bool = True, through_outage: bool = False) -> JobView:
    """The job's view once it has ended, or after ``wait`` seconds (with the text so far).

    Each wake-up by a reconnect of the waiter reads the record again; one by the job's end
    carries the ended state. ``through_outage``: a Redis error while waiting is waited out until ``wait``
    ends, instead of answered with 503 (the caller's job is already running)."""
    if wait <= 0:
        return await run_in_threadpool(service.view, job_id, partial)
    loop = asyncio.get_running_loop()
    end = loop.time() + wait
    view: JobView | None = None
    rec: JobRecord | None = None
    async with waiter.watch(job_id) as woken:
        while True:
            # Woken by the job's terminal move: the record read before, with the move's
            # fields, is the record now (an ended record never changes), so no read.
            ended = rec.ended(parse_wake(woken.payload)) if rec is not None else None
            try:
                rec = ended if ended is not None else await run_in_threadpool(service.record, job_id)
                view = service.view_of(rec, False)
            except UNAVAILABLE_ERRORS:
                if not through_outage:
                    raise
                view = rec = None
            if view is not None and view.status.terminal:
                return view
            left = end - loop.time()
            if left <= 0:
                break
            await within(woken.wait(), min(left, 1.0) if view is None else left)
            woken.clear()
    if view is None:
        raise UnavailableError("the queue (Redis) is unavailable; retry shortly")
    return await run_in_threadpool(service.view, job_id, partial) if partial else view


def chord(header: list[Signature], body: Signature) -> Signature:
    """A job's signature. Several prompts: Celery's chord of their chains, with ``collect``
    as its callback. One prompt: its chain alone, whose postprocess task takes ``collect``'s
    arguments and collects the job itself, so a single-prompt job costs three Celery hops,
    not four, and no chord state (docs/benchmarks.md). Either way ``apply_async(task_id=
    job_id)`` gives the last task the job id."""
    if len(header) != 1:
        return celery_chord(header, body)
    single = header[0].clone()
    last = single.tasks[-1]
    last.kwargs = {**(last.kwargs or {}), **(body.kwargs or {})}
    return single


def _model_of(rec: JobRecord, models) -> str | None:
    """The job's model, from its record; one that is no longer served: the default's tokenizer."""
    name = (rec.meta or {}).get("model")
    return name if name in models.names else None


def _input_text(inp: dict[str, Any]) -> str:
    """The text the limits and the admission estimate look at (a token-id prompt: none)."""
    if "prompt" in inp:
        return inp["prompt"]
    if "messages" in inp:
        return " ".join(m.content or "" for m in inp["messages"])
    return ""


def _input_pieces(inp: dict[str, Any]) -> list[str]:
    """The texts max_prompt_chars limits, each on its own: a prompt, or each message's content
    (``limit_pieces``, when the caller gives them: a chat message's content parts, each on its own)."""
    if "limit_pieces" in inp:
        return inp["limit_pieces"]
    if "messages" in inp:
        return [m.content or "" for m in inp["messages"]]
    return [inp["prompt"]] if "prompt" in inp else []


def _error_from_record(rec: JobRecord) -> ErrorBody | None:
    if not rec.error:
        return None
    t = rec.error.get("type")
    return ErrorBody(type=ErrorReason(t) if t in ErrorReason._value2member_map_ else ErrorReason.INTERNAL,
                     message=rec.error.get("message", ""), stage=rec.error.get("stage"), param=rec.error.get("param"))
