"""Reading the per-job token streams that the inference worker writes."""

from __future__ import annotations

import json
from typing import Any

from llmpipe.streaming import stream_key


def apply_entries(entries: list[tuple[Any, dict]], ids_by_index: dict[int, list[int]],
                  prompt_tokens: dict[int, int] | None = None) -> dict[int, list[int]]:
    """Merge stream entries into ``ids_by_index``; returns the ids new to each index.
    ``prompt_tokens`` (optional) collects each index's prompt length, when entries carry it.

    Entries carry their offset, so a replayed entry (a redelivered request) adds nothing."""
    new: dict[int, list[int]] = {}
    for _, fields in entries:
        f = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v) for k, v in fields.items()}
        i, off, delta = int(f["i"]), int(f["o"]), json.loads(f["d"])
        if prompt_tokens is not None and "p" in f:
            prompt_tokens[i] = int(f["p"])
        have = ids_by_index.setdefault(i, [])
        if off > len(have):
            continue  # a gap: wait for the entry that fills it
        fresh = delta[len(have) - off:]
        if fresh:
            have.extend(fresh)
            new.setdefault(i, []).extend(fresh)
    return new


def read_partial(r: Any, job_id: str) -> dict[int, list[int]]:
    ids: dict[int, list[int]] = {}
    apply_entries(r.xrange(stream_key(job_id)), ids)
    return ids
