"""Bearer-key auth and the request body size limit."""

from __future__ import annotations

import hmac

from fastapi import Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from api.deps import ApiKeys
from api.errors import error_json
from llmpipe.messages import ErrorReason

_bearer = HTTPBearer(auto_error=False, description="One of LLMPIPE_API_KEYS, when set.")


async def require_key(request: Request, keys: ApiKeys) -> None:
    """A route's dependency: the request carries one of the app's API keys (any request,
    when none is set)."""
    if not keys:
        return
    cred: HTTPAuthorizationCredentials | None = await _bearer(request)
    if cred is None:
        raise HTTPException(401, "missing API key: send 'Authorization: Bearer <key>'", headers={"WWW-Authenticate": "Bearer"})
    if not any(hmac.compare_digest(cred.credentials, k) for k in keys):
        raise HTTPException(403, "invalid API key")


require_key.llmpipe_api_key = True  # api/openapi.py documents 401 and 403 on these routes


class BodyLimit:
    """Rejects bodies over ``max_bytes`` with 413, by Content-Length or while streaming.
    ``paths``: a path's own (limit, setting), for an upload (``/v1/files``), whose route checks
    its file against its setting as it streams in."""

    def __init__(self, app: ASGIApp, max_bytes: int, paths: dict[str, tuple[int, str]] | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.paths = paths or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit, setting = self.paths.get(scope.get("path", ""), (self.max_bytes, "max_body_bytes"))
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                return await self._reject(scope, receive, send, limit, setting)
        seen = 0

        async def limited() -> dict:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise _TooLarge
            return msg

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await self._reject(scope, receive, send, limit, setting)

    async def _reject(self, scope, receive, send, limit: int, setting: str) -> None:
        resp = error_json(413, ErrorReason.LIMIT_EXCEEDED, f"request body is over {limit} bytes ({setting})")
        await resp(scope, receive, send)


class _TooLarge(Exception):
    pass
