"""The one place where errors become HTTP responses, all in one schema.

``ERROR_TABLE`` is the whole mapping, as data: for each error type its status, whether a
client should retry, and a description (the OpenAPI responses are built from it). Every
error response carries ``x-should-retry: true|false``: the ``openai`` client (and every
Stainless-generated client) obeys it before it looks at the status, and the statuses of
final errors are ones that generic clients do not retry either. So a request that failed
for good (a poison prompt, a passed deadline, a cancelled job) is not sent again, and
makes one job and one dead letter. Retryable errors (429, 503, 409 ``idempotency_key_in_use``)
come with ``Retry-After``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis.exceptions
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from kombu.exceptions import OperationalError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.disconnect import ClientGone
from llmpipe.errors import LimitExceededError, LlmpipeError, NoLiveWorkerError, OverloadedError
from llmpipe.messages import ErrorReason

log = logging.getLogger("llmpipe.api")

RETRY_HEADER = "x-should-retry"  # read by the openai client's _should_retry before the status


class ErrorBody(BaseModel):
    type: ErrorReason
    message: str
    param: str | None = None
    stage: str | None = None


# Every error answer's body (a failed job's ``error`` is an ErrorBody too). No docstring: it
# would become the schema's description in /openapi.json.
class ErrorResponse(BaseModel):
    error: ErrorBody


@dataclass(frozen=True)
class HttpError:
    status: int
    reason: ErrorReason
    retry: bool  # worth sending the same request again (after Retry-After, if given)
    description: str


# The first row of a reason is its status wherever the reason is raised; the 413 and 422
# rows are the HTTP edge's own (body size, body validation). A body that fails validation
# is 422 on the job API and 400 (the first row) on the routes in OPENAI_STYLE_PATHS, as
# vLLM and OpenAI answer it. Every error body also carries ``code``: its status, as vLLM's.
ERROR_TABLE: tuple[HttpError, ...] = (
    HttpError(400, ErrorReason.INVALID_REQUEST, False,
              "Invalid request; on the OpenAI and vLLM routes also a body that failed validation (as vLLM answers)"),
    HttpError(400, ErrorReason.CONTEXT_LENGTH_EXCEEDED, False, "The prompt does not fit the model's context"),
    HttpError(400, ErrorReason.LIMIT_EXCEEDED, False, "A server limit was exceeded; the message names it"),
    HttpError(401, ErrorReason.UNAUTHORIZED, False, "Missing API key"),
    HttpError(403, ErrorReason.FORBIDDEN, False, "Wrong API key"),
    HttpError(404, ErrorReason.NOT_FOUND, False, "Unknown job, file or batch"),
    HttpError(404, ErrorReason.MODEL_NOT_FOUND, False, "The request's model is not served here (GET /v1/models lists them)"),
    HttpError(409, ErrorReason.CANCELLED, False, "The job was cancelled (or deleted) before it finished"),
    HttpError(409, ErrorReason.IDEMPOTENCY_KEY_IN_USE, True,
              "The first request with this Idempotency-Key is still being admitted; retry after Retry-After"),
    HttpError(413, ErrorReason.LIMIT_EXCEEDED, False,
              "Body too large (max_body_bytes; an upload to /v1/files: batch_max_file_bytes)"),
    HttpError(422, ErrorReason.INVALID_REQUEST, False, "Body failed validation (job API); the message names the field"),
    HttpError(422, ErrorReason.IDEMPOTENCY_KEY_REUSED, False, "This Idempotency-Key was used with a different body"),
    HttpError(424, ErrorReason.ENGINE_ERROR, False,
              "The engine failed on this request after isolation and retries (dead-lettered); sending it again fails again"),
    HttpError(429, ErrorReason.OVERLOADED, True, "A stage queue is full; retry after Retry-After seconds"),
    HttpError(500, ErrorReason.INTERNAL, False, "Internal error (the job failed in a task, or a bug); dead-lettered"),
    HttpError(503, ErrorReason.UNAVAILABLE, True, ("Redis is unavailable, or (/healthz, vLLM's /health, /tokenize) a stage has "
                                                     "no live worker (``stages`` names them); retry after Retry-After seconds")),
    HttpError(504, ErrorReason.EXPIRED, False,
              "The request's deadline (timeout) passed before it finished; it is final, send a new request to try again"),
)

_BY_REASON: dict[ErrorReason, HttpError] = {}
for _row in ERROR_TABLE:
    _BY_REASON.setdefault(_row.reason, _row)
VALIDATION = next(r for r in ERROR_TABLE if r.status == 422 and r.reason is ErrorReason.INVALID_REQUEST)
VALIDATION_OPENAI = next(r for r in ERROR_TABLE if r.status == 400 and r.reason is ErrorReason.INVALID_REQUEST)
OPENAI_STYLE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/files",
                                "/v1/batches"})
BODY_TOO_LARGE = next(r for r in ERROR_TABLE if r.status == 413)


class PayloadTooLargeError(LimitExceededError):
    """A body over its limit, found past the edge (an upload as it streams, a batch line):
    the table's 413 row, as the edge answers it."""

    status = 413


def mapping_for(reason: ErrorReason, status: int | None = None) -> HttpError:
    """The reason's row: its first, or its row of ``status`` (an error raised with the edge's
    own status, such as 413 for an upload over its limit)."""
    if status is not None:
        for row in ERROR_TABLE:
            if row.reason is reason and row.status == status:
                return row
    return _BY_REASON.get(reason, _BY_REASON[ErrorReason.INTERNAL])


def row_of(exc: LlmpipeError) -> HttpError:
    """The row an error is answered with (its ``status`` attribute picks among its reason's rows)."""
    return mapping_for(exc.reason, getattr(exc, "status", None))


def _describe(status: int) -> dict:
    return {"description": "; ".join(r.description for r in ERROR_TABLE if r.status == status)}


# Documented on every route that can answer them (OpenAPI), built from the table.
ERROR_RESPONSES = {status: _describe(status) for status in sorted({r.status for r in ERROR_TABLE})}


def responses(*statuses: int) -> dict[int, dict]:
    """A route's (or the app's) ``responses`` for these error statuses, in the error schema."""
    return {s: {"model": ErrorResponse, **ERROR_RESPONSES[s]} for s in statuses}


def error_body(status: int, reason: ErrorReason, message: str, param: str | None = None, **extra) -> dict:
    """The body of an error answer. "code": the HTTP status, as vLLM's error body carries it."""
    return {"error": {"type": reason.value, "message": message, "param": param, "code": status, **extra}}


def error_json(status: int, reason: ErrorReason, message: str, param: str | None = None,
               headers: dict[str, str] | None = None, *, retry: bool | None = None, **extra) -> JSONResponse:
    if retry is None:
        retry = mapping_for(reason).retry
    return JSONResponse(error_body(status, reason, message, param, **extra), status_code=status,
                        headers={**(headers or {}), RETRY_HEADER: str(retry).lower()})


def answer_of(exc: Exception, path: str, union_tags: frozenset[str] = frozenset()) -> tuple[int, dict]:
    """(status, body) that a request to ``path`` failing with ``exc`` is answered with: a
    typed error's row, a body that failed validation as the path answers it, else 500. The
    Batch API writes a failed line's answer with it, so the line says what the endpoint would."""
    if isinstance(exc, LlmpipeError):
        row = row_of(exc)
        return row.status, error_body(row.status, exc.reason, exc.message, exc.param)
    if isinstance(exc, (RequestValidationError, ValidationError)):
        message, param = validation_message(exc.errors(), union_tags)
        row = VALIDATION_OPENAI if path in OPENAI_STYLE_PATHS else VALIDATION
        return row.status, error_body(row.status, row.reason, message, param)
    return 500, error_body(500, ErrorReason.INTERNAL, f"internal error: {type(exc).__name__}")


def validation_message(errs, union_tags: frozenset[str] = frozenset()) -> tuple[str, str | None]:
    """A validation error's message (its first five errors) and the field it names first."""
    parts = []
    param = None
    for e in list(errs)[:5]:
        loc = [str(x) for x in e.get("loc", ()) if x != "body" and x not in union_tags]
        where = ".".join(loc) or "body"
        param = param or where
        parts.append(f"{where}: {e.get('msg')}")
    return "; ".join(parts) or "invalid request", param


def error_event(reason: ErrorReason, message: str, param: str | None = None) -> dict:
    """The same error schema for an SSE stream that fails after it started (status 200 is
    sent): ``code`` is the status the error has in the table, as vLLM's stream errors carry."""
    return {"error": {"type": reason.value, "message": message, "param": param, "code": mapping_for(reason).status}}


def status_for(exc: LlmpipeError) -> int:
    return mapping_for(exc.reason).status


def install(app: FastAPI, *, union_tags: frozenset[str] = frozenset()) -> None:
    """Map every error of ``app`` to its response. ``union_tags``: the tags of the body unions
    (api/jobs/protocol.py UNION_TAGS), left out of a validation error's field path."""

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, exc: ClientGone):
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(LlmpipeError)
    async def _llmpipe(_: Request, exc: LlmpipeError):
        row = row_of(exc)
        headers = {}
        extra = {}
        if isinstance(exc, OverloadedError):
            headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
            extra["stage"] = exc.stage
        elif row.retry:
            headers["Retry-After"] = str(max(1, round(getattr(exc, "retry_after_s", 2.0))))
        if isinstance(exc, NoLiveWorkerError):
            extra["stages"] = exc.stages
        return error_json(row.status, exc.reason, exc.message, exc.param, headers, **extra)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc.errors(), union_tags)
        row = VALIDATION_OPENAI if request.url.path in OPENAI_STYLE_PATHS else VALIDATION
        return error_json(row.status, row.reason, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        reason = {
            401: ErrorReason.UNAUTHORIZED, 403: ErrorReason.FORBIDDEN, 404: ErrorReason.NOT_FOUND,
            413: ErrorReason.LIMIT_EXCEEDED,
        }.get(exc.status_code, ErrorReason.INVALID_REQUEST)
        return error_json(exc.status_code, reason, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(redis.exceptions.ConnectionError)  # also MasterNotFoundError (Sentinel)
    @app.exception_handler(redis.exceptions.TimeoutError)
    @app.exception_handler(redis.exceptions.ReadOnlyError)  # a write that reached a demoted master
    @app.exception_handler(OperationalError)
    async def _redis_down(_: Request, exc: Exception):
        log.warning("redis unavailable: %s", exc)
        return error_json(503, ErrorReason.UNAVAILABLE, "the queue (Redis) is unavailable; retry shortly",
                          headers={"Retry-After": "2"})

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception):
        log.exception("unhandled error")
        return error_json(500, ErrorReason.INTERNAL, f"internal error: {type(exc).__name__}")
