"""Schemathesis hooks for tests/integration/test_openapi_conformance.py (loaded through
SCHEMATHESIS_HOOKS; not a test module)."""

from __future__ import annotations

import uuid

import schemathesis

from api.request_keys import HEADER, KEY_PATTERN


@schemathesis.hook
def before_call(context, case, kwargs):
    # An Idempotency-Key names one request: the same key with another body is 422 by design
    # (the IETF draft's rule), which no schema can state. Generated clients would reuse the
    # few keys they draw for different bodies; each call gets a key of its own instead,
    # still one the schema allows, so the key's own validation is still exercised.
    key = (case.headers or {}).get(HEADER)
    if isinstance(key, str) and KEY_PATTERN.fullmatch(key):
        case.headers[HEADER] = (key[:200] + uuid.uuid4().hex)[:255]
