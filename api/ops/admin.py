"""Operator endpoints: the dead-letter record."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query

from llmpipe.errors import NotFoundError
from llmpipe.jobs.deadletter import DeadLetters


def router(r: Any, ttl_s: int, max_entries: int) -> APIRouter:
    rt = APIRouter(prefix="/v1/admin", tags=["admin"])
    dl = DeadLetters(r, ttl_s=ttl_s, max_entries=max_entries)

    @rt.get("/deadletters")
    def list_deadletters(limit: int = Query(100, ge=1, le=1000)) -> dict:
        """Requests that kept failing (after retries, or past the delivery limit), newest first."""
        return {"count": dl.count(), "data": dl.list(limit)}

    @rt.delete("/deadletters/{entry_id}", status_code=204, responses={404: {"description": "Unknown entry"}})
    def delete_deadletter(entry_id: str) -> None:
        """Forget one dead letter once handled."""
        if not dl.remove(entry_id):
            raise NotFoundError(f"no dead letter with id {entry_id!r}", param="entry_id")

    return rt
