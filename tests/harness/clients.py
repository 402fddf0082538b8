"""HTTP clients of a test's stack: a job submitted, read, and waited for through the job API."""

from __future__ import annotations

import httpx

from tests.harness.waiting import poll


def submit_job(url: str, body: dict, *, headers: dict | None = None) -> str:
    """POST /v1/jobs; the new job's id (202 asserted)."""
    r = httpx.post(f"{url}/v1/jobs", json=body, headers=headers, timeout=10)
    assert r.status_code == 202, r.text
    return r.json()["id"]


def job_view(url: str, job_id: str, *, wait: float = 0, headers: dict | None = None) -> dict:
    """The job's view; ``wait``: long-poll up to that many seconds for it to end."""
    params = {"wait": wait} if wait else None
    return httpx.get(f"{url}/v1/jobs/{job_id}", params=params, headers=headers, timeout=wait + 20).json()


def job_result(url: str, job_id: str, timeout: float = 120) -> dict:
    """The job's view once it ended, in long-polls of 10 s; after ``timeout``, as it is."""
    last: dict = {}

    def ended() -> bool:
        last["view"] = job_view(url, job_id, wait=10)
        return last["view"]["status"] not in ("queued", "running")

    poll(ended, timeout, every=0.1)
    return last["view"]
