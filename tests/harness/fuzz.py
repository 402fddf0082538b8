"""Property-based requests (schemathesis) from the API's own OpenAPI document."""

from __future__ import annotations


def fuzz(schema, *, examples: int, include=lambda op: True, **call_kwargs) -> tuple[list[str], dict]:
    """Property-based requests from the API's own OpenAPI spec (schemathesis), valid and
    invalid ones; returns the failures (a 5xx, or a traceback in a body) and the codes seen."""
    from collections import Counter

    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    failures: list[str] = []
    codes: Counter = Counter()
    for res in schema.get_all_operations():
        op = res.ok()
        if not include(op):
            continue
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck), phases=[Phase.generate])
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                try:
                    resp = case.call(**call_kwargs)
                except Exception as exc:  # the transport failing is a failure too (a crash, a hang)
                    failures.append(f"{op.method.upper()} {op.path} [{mode.value}] raised {type(exc).__name__}: {exc} "
                                    f"for {case.as_curl_command()[:800]}")
                    return
                codes[f"{op.method.upper()} {op.path} {resp.status_code}"] += 1
                if resp.status_code >= 500 or "Traceback" in resp.text:
                    failures.append(f"{op.method.upper()} {op.path} [{mode.value}] -> {resp.status_code}: "
                                    f"{resp.text[:300]} for {case.as_curl_command()[:500]}")

            try:
                run()
            except Unsatisfiable:  # e.g. no invalid request exists for an operation without inputs
                codes[f"{op.method.upper()} {op.path} [{mode.value}] nothing to generate"] += 1
    return failures, dict(codes)
