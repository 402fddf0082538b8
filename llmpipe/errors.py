"""Typed errors. Each carries its ErrorReason; the HTTP edge maps them once (api/errors.py)."""

from __future__ import annotations

from llmpipe.messages import ErrorReason, Stage, StageError


class LlmpipeError(Exception):
    reason: ErrorReason = ErrorReason.INTERNAL

    def __init__(self, message: str, *, reason: ErrorReason | None = None, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if reason is not None:
            self.reason = reason

    def to_stage_error(self, stage: Stage | None = None) -> StageError:
        return StageError(reason=self.reason, message=self.message, stage=stage, param=self.param)


class BadRequestError(LlmpipeError):
    """The client's fault: invalid input or a limit exceeded."""

    reason = ErrorReason.INVALID_REQUEST


class ContextLengthError(BadRequestError):
    reason = ErrorReason.CONTEXT_LENGTH_EXCEEDED


class LimitExceededError(BadRequestError):
    reason = ErrorReason.LIMIT_EXCEEDED


class NotFoundError(LlmpipeError):
    reason = ErrorReason.NOT_FOUND


class ModelNotFoundError(NotFoundError):
    """The request names a model that is not served here."""

    reason = ErrorReason.MODEL_NOT_FOUND


class OverloadedError(LlmpipeError):
    """A stage is backed up; retry later."""

    reason = ErrorReason.OVERLOADED

    def __init__(self, message: str, *, stage: str, retry_after_s: float):
        super().__init__(message)
        self.stage = stage
        self.retry_after_s = retry_after_s


class UnavailableError(LlmpipeError):
    """A dependency (Redis) is down."""

    reason = ErrorReason.UNAVAILABLE


class NoLiveWorkerError(UnavailableError):
    """A stage of the pipeline has no live worker: jobs would wait until one comes back."""

    def __init__(self, stages: list[str], *, retry_after_s: float = 5.0):
        super().__init__(f"no live worker for: {', '.join(stages)}")
        self.stages = stages
        self.retry_after_s = retry_after_s


class EngineError(LlmpipeError):
    """The engine failed on a batch or a request."""

    reason = ErrorReason.ENGINE_ERROR

    def __init__(self, message: str, *, transient: bool = False):
        super().__init__(message)
        self.transient = transient


class EngineBadRequestError(EngineError):
    """The engine refused one request for what it asks (a bad JSON schema, say): the
    client's fault, so it fails alone and is not retried."""

    reason = ErrorReason.INVALID_REQUEST

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineDeadError(EngineError):
    """The engine process is gone; the worker must exit so its requests are redelivered."""


class ExpiredError(LlmpipeError):
    reason = ErrorReason.EXPIRED


class CancelledError(LlmpipeError):
    reason = ErrorReason.CANCELLED
