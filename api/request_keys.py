"""``Idempotency-Key``: a retried POST maps to the job its first attempt made.

Clients retry: the ``openai`` client does so on timeouts, connection errors, 408, 409, 429
and 5xx, and generic HTTP clients on 5xx. A client that sends ``Idempotency-Key`` gets one
job per key, whatever it retries (the IETF httpapi draft and Stripe's semantics):

* the key is claimed in Redis (one Lua step) BEFORE admission, scoped by API key, with the
  fingerprint of the body, so two attempts never both make a job;
* a retry with the same body gets the job that exists: ``POST /v1/jobs`` answers with its
  id again, the OpenAI endpoints wait on it (or stream it from its first token);
* the same key with a different body is 422 ``idempotency_key_reused``;
* a retry that arrives while the first attempt is still being admitted waits a moment,
  then gets 409 ``idempotency_key_in_use`` (retryable);
* a claim whose job was never made (429, 503) is released, so the retry is admitted anew;
  a job whose waiting clients all went away (cancelled on disconnect) is replaced by a new
  one, since nobody will ever read it.

A claim lives ``claim_ttl_s`` until its job record exists (a crashed API process does not
pin the key), then as long as the job record (``result_ttl_s``).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from llmpipe.errors import BadRequestError, LlmpipeError
from llmpipe.jobs.store import KEY_PREFIX
from llmpipe.messages import ErrorReason

HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"  # on an answer that is the job an earlier request made
MAX_KEY_LEN = 255
# Printable ASCII, as the IETF draft's sf-string; the same rule is in the OpenAPI schema.
KEY_PATTERN = re.compile(rf"[\x20-\x7e]{{1,{MAX_KEY_LEN}}}")

# KEYS: the claim hash. ARGV: new job id, fingerprint, claim TTL, job key prefix, attach (1/0)
_CLAIM = """
local job = redis.call('HGET', KEYS[1], 'job')
if not job then
  redis.call('HSET', KEYS[1], 'job', ARGV[1], 'fp', ARGV[2])
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  return {'new', ARGV[1], ''}
end
if redis.call('HGET', KEYS[1], 'fp') ~= ARGV[2] then return {'mismatch', job, ''} end
local jk = ARGV[4] .. job
local rec = redis.call('HMGET', jk, 'status', 'abandoned', 'deadline')
if not rec[1] then return {'pending', job, ''} end
if rec[2] == '1' then
  redis.call('HSET', KEYS[1], 'job', ARGV[1])
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  return {'new', ARGV[1], ''}
end
if ARGV[5] == '1' then redis.call('HINCRBY', jk, 'waiters', 1) end
return {'existing', job, rec[3]}
"""

# Drops a claim if it still names this job (its job was never made).
_RELEASE = """
if redis.call('HGET', KEYS[1], 'job') == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class IdempotencyKeyReused(LlmpipeError):
    reason = ErrorReason.IDEMPOTENCY_KEY_REUSED


class IdempotencyKeyInUse(LlmpipeError):
    reason = ErrorReason.IDEMPOTENCY_KEY_IN_USE
    retry_after_s = 1.0


@dataclass(frozen=True)
class RequestKey:
    """One client's Idempotency-Key and the fingerprint of the request it came with."""

    redis_key: str
    fingerprint: str
    raw: str


def request_key(header: str | None, *, api_key: str | None, path: str, body: Any) -> RequestKey | None:
    """The request's key, or None without the header. ``body`` is the parsed request model."""
    if header is None:
        return None
    if not KEY_PATTERN.fullmatch(header):
        raise BadRequestError(f"{HEADER} must be 1 to {MAX_KEY_LEN} printable ASCII characters", param=HEADER)
    scope = hashlib.sha256(api_key.encode()).hexdigest()[:16] if api_key else "anonymous"
    digest = hashlib.sha256(header.encode()).hexdigest()
    dumped = body.model_dump(mode="json") if hasattr(body, "model_dump") else body
    fp = hashlib.sha256(json.dumps({"path": path, "body": dumped}, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return RequestKey(f"llmpipe:idem-key:{scope}:{digest}", fp, header)


def key_of(request: Request, header: str | None, body: Any) -> RequestKey | None:
    """The key of an HTTP request with the ``Idempotency-Key`` value ``header``, scoped by its
    API key (the bearer token), for its path and parsed ``body``."""
    auth = request.headers.get("authorization", "")
    api_key = auth[7:].strip() if auth[:7].lower() == "bearer " else None
    return request_key(header, api_key=api_key, path=request.url.path, body=body)


@dataclass(frozen=True)
class Claim:
    job_id: str
    existing: bool  # the key already named a job: no new one is made
    deadline: float | None = None  # the existing job's deadline


class RequestKeys:
    def __init__(self, r: Any, *, ttl_s: int, claim_ttl_s: int = 30, wait_s: float = 2.0,
                 sleep: Callable[[float], None] = time.sleep):
        self.r = r
        self.ttl_s = ttl_s
        self.claim_ttl_s = claim_ttl_s
        self.wait_s = wait_s
        self._sleep = sleep
        self._claim = r.register_script(_CLAIM)
        self._release = r.register_script(_RELEASE)

    def claim(self, key: RequestKey, job_id: str, *, attach: bool) -> Claim:
        """Claim ``key`` for ``job_id``, or get the job it already names. With ``attach`` the
        caller counts as one more waiter of an existing job."""
        delay, waited = 0.02, 0.0
        while True:
            kind, job, deadline = (_s(v) for v in self._claim(
                keys=[key.redis_key], args=[job_id, key.fingerprint, self.claim_ttl_s, KEY_PREFIX, int(attach)]))
            if kind == "new":
                return Claim(job, False)
            if kind == "existing":
                return Claim(job, True, float(deadline) if deadline else None)
            if kind == "mismatch":
                raise IdempotencyKeyReused(
                    f"{HEADER} {key.raw!r} was already used with a different request body; use a new key",
                    param=HEADER)
            # pending: the first attempt holds the key and is being admitted right now
            if waited >= self.wait_s:
                raise IdempotencyKeyInUse(
                    f"a request with {HEADER} {key.raw!r} is still being admitted; retry shortly", param=HEADER)
            self._sleep(delay)
            waited += delay
            delay = min(delay * 2, 0.5)

    def keep(self, pipe: Any, key: RequestKey) -> None:
        """Once the job record exists, the claim lives as long as it (queued on ``pipe``)."""
        pipe.expire(key.redis_key, self.ttl_s)

    def release(self, key: RequestKey, job_id: str) -> None:
        self._release(keys=[key.redis_key], args=[job_id])


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else v
