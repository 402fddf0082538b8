"""The OpenAPI document says what the API answers: every error status of every route, from
the one error mapping (api/errors.py ERROR_TABLE), and the methods of each path.

``ROUTE_ERRORS`` lists, per operation, the statuses it can answer besides success; each is
documented with the error schema and the table's descriptions. Every route can also answer
500 (a bug), and a route behind the API keys 401 and 403 (once keys are configured). A route
missing from the table fails the unit tests (tests/api/test_openapi.py), so a new route is
documented when it is added.

``MethodsAllowed`` answers a method a path does not have as RFC 9110 says: ``OPTIONS`` with
204 and ``Allow``, any other with 405 and ``Allow`` (Starlette lists only the methods of the
first route that matches the path).
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import Response
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

from api.errors import ERROR_RESPONSES, ErrorResponse, error_json
from api.request_keys import HEADER as KEY_HEADER
from api.request_keys import KEY_PATTERN
from llmpipe.messages import ErrorReason

BODY = (413,)  # any request with a body: over max_body_bytes
REDIS = (503,)  # the route reads or writes Redis

ROUTE_ERRORS: dict[tuple[str, str], tuple[int, ...]] = {
    ("POST", "/v1/jobs"): (400, 404, 409, 422, 429, *BODY, *REDIS),  # 404: model_not_found
    ("GET", "/v1/jobs/{job_id}"): (404, 422, *REDIS),
    ("DELETE", "/v1/jobs/{job_id}"): (404, *REDIS),
    ("POST", "/v1/jobs/{job_id}/cancel"): (404, *REDIS),
    ("POST", "/v1/completions"): (400, 404, 409, 422, 424, 429, 504, *BODY, *REDIS),
    ("POST", "/v1/chat/completions"): (400, 404, 409, 422, 424, 429, 504, *BODY, *REDIS),
    ("GET", "/v1/models"): (),
    # 400: a body or query that failed validation (OpenAI's), a purpose or file that will not do;
    # 404 on a list: an ``after`` cursor naming nothing; 413: an upload over batch_max_file_bytes.
    ("POST", "/v1/files"): (400, *BODY, *REDIS),
    ("GET", "/v1/files"): (400, 404, *REDIS),
    ("GET", "/v1/files/{file_id}"): (404, *REDIS),
    ("GET", "/v1/files/{file_id}/content"): (404, *REDIS),
    ("DELETE", "/v1/files/{file_id}"): (404, *REDIS),
    ("POST", "/v1/batches"): (400, 404, *BODY, *REDIS),
    ("GET", "/v1/batches"): (400, 404, *REDIS),
    ("GET", "/v1/batches/{batch_id}"): (404, *REDIS),
    ("POST", "/v1/batches/{batch_id}/cancel"): (404, *REDIS),
    ("GET", "/metrics"): (),
    ("GET", "/v1/admin/deadletters"): (422, *REDIS),
    ("DELETE", "/v1/admin/deadletters/{entry_id}"): (404, *REDIS),
    ("GET", "/health"): REDIS,
    ("GET", "/ping"): REDIS,
    ("POST", "/ping"): REDIS,
    ("GET", "/version"): (),
    ("POST", "/tokenize"): (400, 404, *BODY, *REDIS),
    ("POST", "/detokenize"): (400, 404, *BODY),
    ("GET", "/healthz"): REDIS,
}
# Answered with an empty body, as vLLM's probes.
EMPTY_OK = {("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")}
# With ``stream: true`` the answer is server-sent events.
STREAMS = {("POST", "/v1/completions"), ("POST", "/v1/chat/completions")}
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string", "description": (
    "A chunk as JSON (the JSON answer's shape with `delta`s, or the error body), then `[DONE]`.")}},
    "description": "With stream: true: one event per chunk."}
ALWAYS = (500,)
_KEY_SCHEMA = {"type": "string", "pattern": f"^{KEY_PATTERN.pattern}$"}
AUTH = (401, 403)


def _error(status: int) -> dict:
    return {"description": ERROR_RESPONSES[status]["description"],
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}


def _behind_key(route) -> bool:
    return any(getattr(d.dependency, "llmpipe_api_key", False) for d in getattr(route, "dependencies", ()))


def document_errors(app: FastAPI, spec: dict) -> None:
    """Replace each operation's error responses with the ones ROUTE_ERRORS gives it."""
    protected = {(m, r.path) for r in app.routes for m in getattr(r, "methods", ()) or () if _behind_key(r)}
    for path, ops in spec.get("paths", {}).items():
        for method, op in ops.items():
            key = (method.upper(), path)
            statuses = set(ROUTE_ERRORS.get(key, ())) | set(ALWAYS)
            if key in protected:
                statuses |= set(AUTH)
            responses = {code: r for code, r in op.get("responses", {}).items() if int(code) < 400}
            if key in EMPTY_OK:
                responses["200"].pop("content", None)
            if key in STREAMS:
                responses["200"].setdefault("content", {})["text/event-stream"] = {"schema": _SSE_EVENT}
            responses.update({str(s): _error(s) for s in sorted(statuses)})
            op["responses"] = responses
            for param in op.get("parameters", ()):
                if param.get("in") == "header" and param.get("name") == KEY_HEADER:
                    param["schema"] = {**_KEY_SCHEMA, "description": param["schema"].get("description", "")}
    schemas = spec.get("components", {}).get("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422 body; ours is ErrorResponse
        schemas.pop(unused, None)
    if "ErrorResponse" not in schemas:
        schemas["ErrorResponse"] = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schemas["ErrorResponse"].pop("$defs", {}))


class MethodsAllowed:
    """204 with ``Allow`` for OPTIONS, 405 with ``Allow`` for a method the path lacks."""

    def __init__(self, app: ASGIApp, routes_of):
        self.app = app
        self.routes_of = routes_of  # () -> the app's routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        allowed: set[str] = set()
        for route in self.routes_of():
            match, _ = route.matches(scope)
            if match is Match.FULL:
                return await self.app(scope, receive, send)
            if match is Match.PARTIAL:
                allowed |= set(getattr(route, "methods", ()) or ())
        if not allowed:
            return await self.app(scope, receive, send)
        allow = ", ".join(sorted(allowed | {"OPTIONS"}))
        if scope["method"] == "OPTIONS":
            resp: Response = Response(status_code=204, headers={"Allow": allow})
        else:
            resp = error_json(405, ErrorReason.INVALID_REQUEST, f"method {scope['method']} is not allowed here; "
                              f"allowed: {allow}", headers={"Allow": allow})
        await resp(scope, receive, send)
