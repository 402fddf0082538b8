"""The bodies of the CPU stages' tasks (tasks/preprocess.py, tasks/postprocess.py,
tasks/tokenize.py), without Celery: a message in, the next stage's message out, as JSON.

Each takes what it works with as arguments: the job store, the memo, and ``models``, which
gives a served model's resources by name (None: the default model; an unknown name raises
ModelNotFoundError), each with its ``input_processor`` and ``output_processor``
(workers/context.py ModelResources in a worker).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmpipe.errors import CancelledError, ExpiredError, LlmpipeError, ModelNotFoundError
from llmpipe.jobs.memo import StageMemo
from llmpipe.jobs.store import JobStore
from llmpipe.messages import Generation, JobStatus, PromptRequest, Stage, StageError, TokenizedRequest
from llmpipe.observability import metrics
from llmpipe.processors.collector import JobFinisher
from llmpipe.processors.envelope import as_json

Models = Callable[[str | None], Any]


class PreprocessStage:
    """``llmpipe.preprocess``: PromptRequest -> TokenizedRequest with the request's model's tokenizer.

    ``route``: where a tokenized request's inference goes, a worker's own queue or None for
    its model's shared queue (llmpipe/routing/); ``run`` tells ``send_next_to``."""

    def __init__(self, jobs: JobStore, models: Models, default_model: str,
                 route: Callable[[TokenizedRequest], str | None] | None = None):
        self.jobs = jobs
        self.models = models
        self.default_model = default_model
        self.route = route

    def run(self, msg: dict, send_next_to: Callable[[str], None] | None = None) -> dict:
        req = PromptRequest.model_validate(msg)
        if req.error is None:
            req.error = self._ended(req.job_id)
        try:
            model = self.models(req.model)  # the request's model's tokenizer, loaded once per process
        except ModelNotFoundError as exc:  # this worker's settings serve other models than the API's
            req.error = req.error or exc.to_stage_error(Stage.PREPROCESS)
            model = self.models(None)  # passes the failed request on untouched
        out = model.input_processor.process(req)
        if send_next_to is not None and self.route is not None and out.error is None:
            queue = self.route(out)  # the worker whose engine most likely caches this prompt's prefix
            if queue is not None:
                send_next_to(queue)
        metrics.observe_stage(out.timings[-1], req.model or self.default_model)
        metrics.observe_error(out.error and out.error.reason.value, Stage.PREPROCESS.value)
        return as_json(out)

    def _ended(self, job_id: str) -> StageError | None:
        """One step: the job moves to running; a job that already ended (cancelled by DELETE
        or a client that left, expired at the API) gets an error and is not worked on."""
        status = self.jobs.start(job_id)
        if status is None or not status.terminal:
            return None
        err = ExpiredError if status == JobStatus.EXPIRED else CancelledError
        return err(f"job {status.value} before preprocess").to_stage_error(Stage.PREPROCESS)


class PostprocessStage:
    """``llmpipe.postprocess``: Generation -> PromptResult with the request's model's tokenizer.

    A job of one prompt is one chain, no chord: postprocess is its last hop and collects it
    (``job_id`` given; its task id is the job id, so its stored result is where the chord's
    would be). No memo then: detokenizing is deterministic, the record's first terminal
    write wins, and a redelivery returns what the record holds (JobFinisher)."""

    def __init__(self, memo: StageMemo, models: Models, default_model: str, finisher: JobFinisher):
        self.memo = memo
        self.models = models
        self.default_model = default_model
        self.finisher = finisher

    def run(self, msg: dict, job_id: str | None = None, submitted_at: float | None = None,
            model: str | None = None) -> dict:
        gen = Generation.model_validate(msg)
        if job_id is not None:
            return self.finisher.finish([self._post(gen)], job_id, submitted_at, model)
        # Idempotent by request id: a redelivered message returns the first run's result.
        value, _ = self.memo.run(Stage.POSTPROCESS.value, gen.request_id, gen.deadline, lambda: self._post(gen))
        return value

    def _post(self, gen: Generation) -> dict:
        result = self.models(gen.model).output_processor.process(gen)  # the request's model's tokenizer
        model = gen.model or self.default_model
        t = result.timings[Stage.POSTPROCESS]
        metrics.observe_stage_times(Stage.POSTPROCESS.value, t.queue_wait_s, t.run_s, model)
        if gen.first_token_at is not None and gen.timings:
            metrics.TTFT.labels(model).observe(max(0.0, gen.first_token_at - gen.timings[0].enqueued_at))
        return as_json(result)


class TokenizeStage:
    """``llmpipe.tokenize`` (``POST /tokenize``) on the preprocess queue: the stage that
    tokenizes every prompt answers, so the ids are the ones a request would carry
    (api/vllm/router.py). A client's mistake is an ``error`` in the answer, not a failure."""

    def __init__(self, models: Models):
        self.models = models

    def run(self, body: dict) -> dict:
        try:
            body = dict(body)
            return self.models(body.pop("model", None)).input_processor.tokenize_view(**body)
        except LlmpipeError as exc:
            return {"error": {"type": exc.reason.value, "message": exc.message, "param": exc.param}}
        except Exception as exc:
            if not any(c.__name__ == "TemplateError" for c in type(exc).__mro__):
                raise
            # The chat template refused these messages (jinja2's raise_exception): the client's fault.
            return {"error": {"type": "invalid_request", "message": f"chat template: {exc}", "param": "messages"}}
