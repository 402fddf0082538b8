"""OpenAI's list paging (``after``, ``limit``, ``has_more``) over a Redis sorted-set index."""

from __future__ import annotations

from typing import Any


def page(r: Any, index: str, *, after: str | None, limit: int, desc: bool, load, keep=lambda rec: True):
    """One page of a sorted-set index after the member ``after`` (None: from the start), as
    OpenAI's list endpoints page; records gone from Redis are skipped. None when ``after``
    is not in the index."""
    start = 0
    if after is not None:
        rank = r.zrevrank(index, after) if desc else r.zrank(index, after)
        if rank is None:
            return None
        start = rank + 1
    out: list = []
    chunk = max(limit + 1, 100)
    while len(out) <= limit:
        ids = [_s(i) for i in (r.zrevrange if desc else r.zrange)(index, start, start + chunk - 1)]
        if not ids:
            break
        out += [rec for rec in load(ids) if rec is not None and keep(rec)]
        start += len(ids)
    return out[:limit], len(out) > limit


def hgetalls(r: Any, prefix: str, ids: list[str]) -> list[dict]:
    pipe = r.pipeline(transaction=False)
    for i in ids:
        pipe.hgetall(prefix + i)
    return pipe.execute()


def _s(v: Any) -> Any:
    return v.decode() if isinstance(v, bytes) else v
