"""The one place where errors become HTTP responses, all in one schema."""

from __future__ import annotations

import logging

import redis.exceptions
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from kombu.exceptions import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmpipe.errors import (
    BadRequestError, CancelledError, EngineError, ExpiredError, LlmpipeError, NotFoundError, OverloadedError,
    UnavailableError,
)
from llmpipe.messages import ErrorReason

log = logging.getLogger("llmpipe.api")

_STATUS: list[tuple[type[LlmpipeError], int]] = [
    (BadRequestError, 400),
    (NotFoundError, 404),
    (ExpiredError, 408),
    (CancelledError, 409),
    (OverloadedError, 429),
    (UnavailableError, 503),
    (EngineError, 502),
]

# Documented on every route that can answer them (OpenAPI).
ERROR_RESPONSES = {
    400: {"description": "Invalid request or a limit exceeded"},
    401: {"description": "Missing API key"},
    403: {"description": "Wrong API key"},
    404: {"description": "Unknown job"},
    413: {"description": "Body too large"},
    422: {"description": "Body failed validation; the message names the field"},
    429: {"description": "A stage queue is full; retry after Retry-After seconds"},
    503: {"description": "Redis is unavailable"},
}


# vLLM's (and OpenAI's) OpenAI-compatible routes answer a body that fails validation
# with 400; the job API keeps FastAPI's 422.
_VALIDATION_400 = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")


def error_json(status: int, reason: ErrorReason, message: str, param: str | None = None,
               headers: dict[str, str] | None = None, **extra) -> JSONResponse:
    # "code": the HTTP status, as vLLM's error body carries it.
    body = {"type": reason.value, "message": message, "param": param, "code": status, **extra}
    return JSONResponse({"error": body}, status_code=status, headers=headers)


def status_for(exc: LlmpipeError) -> int:
    for cls, code in _STATUS:
        if isinstance(exc, cls):
            return code
    return 500


def install(app: FastAPI) -> None:
    @app.exception_handler(LlmpipeError)
    async def _llmpipe(_: Request, exc: LlmpipeError):
        headers = None
        extra = {}
        if isinstance(exc, OverloadedError):
            headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))}
            extra["stage"] = exc.stage
        return error_json(status_for(exc), exc.reason, exc.message, exc.param, headers, **extra)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        parts = []
        param = None
        for e in errs[:5]:
            loc = [str(x) for x in e.get("loc", ()) if x != "body"]
            where = ".".join(loc) or "body"
            param = param or where
            parts.append(f"{where}: {e.get('msg')}")
        status = 400 if request.url.path in _VALIDATION_400 else 422
        return error_json(status, ErrorReason.INVALID_REQUEST, "; ".join(parts) or "invalid request", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        reason = {
            401: ErrorReason.UNAUTHORIZED, 403: ErrorReason.FORBIDDEN, 404: ErrorReason.NOT_FOUND,
            413: ErrorReason.LIMIT_EXCEEDED,
        }.get(exc.status_code, ErrorReason.INVALID_REQUEST)
        return error_json(exc.status_code, reason, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(redis.exceptions.ConnectionError)
    @app.exception_handler(redis.exceptions.TimeoutError)
    @app.exception_handler(OperationalError)
    async def _redis_down(_: Request, exc: Exception):
        log.warning("redis unavailable: %s", exc)
        return error_json(503, ErrorReason.UNAVAILABLE, "the queue (Redis) is unavailable; retry shortly",
                          headers={"Retry-After": "2"})

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception):
        log.exception("unhandled error")
        return error_json(500, ErrorReason.INTERNAL, f"internal error: {type(exc).__name__}")
