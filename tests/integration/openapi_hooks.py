"""Schemathesis hooks for tests/integration/test_openapi_conformance.py (loaded through
SCHEMATHESIS_HOOKS; not a test module)."""

from __future__ import annotations

import uuid

import schemathesis

from api.request_keys import HEADER, KEY_PATTERN
from tests.integration.test_openapi_conformance import LIMITS


@schemathesis.hook
def before_call(context, case, kwargs):
    # An Idempotency-Key names one request: the same key with another body is 422 by design
    # (the IETF draft's rule), which no schema can state. Generated clients would reuse the
    # few keys they draw for different bodies; each call gets a key of its own instead,
    # still one the schema allows, so the key's own validation is still exercised.
    key = (case.headers or {}).get(HEADER)
    if isinstance(key, str) and KEY_PATTERN.fullmatch(key):
        case.headers[HEADER] = (key[:200] + uuid.uuid4().hex)[:255]
    _min_tokens_within_max_tokens(case.body)


def _min_tokens_within_max_tokens(body) -> None:
    """vLLM's rule that min_tokens is at most the request's max_tokens compares two fields,
    which JSON Schema cannot state: a generated min_tokens above the request's max_tokens
    (or the default) is brought down to it. A min_tokens that breaks the schema itself (a
    negative or a non-integer one) is left as generated."""
    if not isinstance(body, dict):
        return
    low = body.get("min_tokens")
    given = [body.get(k) for k in ("max_completion_tokens", "max_tokens")]
    caps = [v for v in given if isinstance(v, int) and not isinstance(v, bool) and v >= 0]
    cap = min(caps) if caps else LIMITS["default_max_tokens"]
    if isinstance(low, int) and not isinstance(low, bool) and low > cap:
        body["min_tokens"] = cap
