"""Files of the Batch API: contents on disk, records in Redis.

A file's contents never sit in Redis. They live under the storage directory (the
``batch_dir`` setting: the state dir by default, or a mount every API process shares) as
``files/<id>.jsonl``; an upload is written there in chunks as it arrives, under a ``.part``
name that is renamed once the upload is whole, so a reader never sees half a file. The
record, a hash at ``llmpipe:file:<id>``, holds what OpenAI's ``File`` object says (size,
name, purpose, times). Two sorted sets index the records: by creation (listing, newest
first) and by expiry (the janitor, :meth:`FileStore.sweep`, deletes a file's contents and
record once ``expires_at`` passes). The record's own TTL is a day longer, a backstop for a
stack where no API process ran the janitor.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmpipe.batches.paging import hgetalls, page

PURPOSE_BATCH = "batch"  # an input file
PURPOSE_OUTPUT = "batch_output"  # a batch's output or error file

_KEY = "llmpipe:file:"
INDEX = "llmpipe:files"  # zset id -> created_at
EXPIRY = "llmpipe:files-expiry"  # zset id -> expires_at
_ID = re.compile(r"file-[0-9a-f]{32}")
_BATCH_ID = re.compile(r"batch_[0-9a-f]{32}")
BACKSTOP_S = 24 * 3600
PART_MAX_AGE_S = 3600  # an upload's .part file older than this was left by a process that died


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def derived_file_id(seed: str) -> str:
    """A file id that ``seed`` always gives (a batch's output and error files), so that a
    process that takes a batch over writes to the same file."""
    return f"file-{hashlib.sha256(seed.encode()).hexdigest()[:32]}"


def valid_file_id(file_id: str) -> bool:
    return bool(_ID.fullmatch(file_id))


def batch_dir(root: Path, batch_id: str) -> Path:
    """A batch's own folder: a link to its input file, so that deleting the file leaves the batch whole."""
    if not _BATCH_ID.fullmatch(batch_id):
        raise ValueError(f"not a batch id: {batch_id!r}")
    return Path(root) / "batches" / batch_id


def batch_input_path(root: Path, batch_id: str) -> Path:
    return batch_dir(root, batch_id) / "input.jsonl"


def output_file_ids(batch_id: str) -> tuple[str, str]:
    """The ids of a batch's output and error files, which its feeders write in place."""
    return derived_file_id(f"{batch_id}:output"), derived_file_id(f"{batch_id}:errors")


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


@dataclass
class FileRecord:
    id: str
    bytes: int
    created_at: float
    filename: str
    purpose: str
    expires_at: float

    def to_hash(self) -> dict[str, Any]:
        return {"id": self.id, "bytes": self.bytes, "created_at": self.created_at, "filename": self.filename,
                "purpose": self.purpose, "expires_at": self.expires_at}

    @classmethod
    def from_hash(cls, h: dict) -> FileRecord:
        d = {_s(k): _s(v) for k, v in h.items()}
        return cls(id=d["id"], bytes=int(d["bytes"]), created_at=float(d["created_at"]), filename=d["filename"],
                   purpose=d["purpose"], expires_at=float(d["expires_at"]))


class TooLarge(Exception):
    """An upload went over its limit while it streamed in."""

    def __init__(self, limit: int):
        super().__init__(f"over {limit} bytes")
        self.limit = limit


class Upload:
    """One upload, written as it arrives: ``write`` each chunk (over ``max_bytes`` in all:
    :class:`TooLarge`, and the partial file is gone), then ``commit``; ``abort`` drops it."""

    def __init__(self, part: Path, final: Path, max_bytes: int):
        self.part, self.final, self.max_bytes = part, final, max_bytes
        self.size = 0
        part.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(part, "wb")  # noqa: SIM115 - closed by commit or abort

    def write(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.max_bytes:
            self.abort()
            raise TooLarge(self.max_bytes)
        self._f.write(chunk)

    def commit(self) -> int:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self.part, self.final)
        return self.size

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
        with contextlib.suppress(FileNotFoundError):
            self.part.unlink()


class FileStore:
    def __init__(self, r: Any, root: Path, *, retention_s: int, clock=time.time):
        self.r = r
        self.root = Path(root)
        self.retention_s = retention_s
        self._clock = clock

    @property
    def files_dir(self) -> Path:
        return self.root / "files"

    def path(self, file_id: str) -> Path:
        if not valid_file_id(file_id):  # ids name paths: never one a client made up
            raise ValueError(f"not a file id: {file_id!r}")
        return self.files_dir / f"{file_id}.jsonl"

    def upload(self, file_id: str, max_bytes: int) -> Upload:
        final = self.path(file_id)
        return Upload(final.with_name(final.name + ".part"), final, max_bytes)

    def create(self, rec: FileRecord) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(_KEY + rec.id, mapping=rec.to_hash())
        pipe.expireat(_KEY + rec.id, int(rec.expires_at + BACKSTOP_S))
        pipe.zadd(INDEX, {rec.id: rec.created_at})
        pipe.zadd(EXPIRY, {rec.id: rec.expires_at})
        pipe.execute()

    def record(self, file_id: str, size: int, filename: str, purpose: str, *, now: float | None = None,
               expires_after_s: float | None = None) -> FileRecord:
        """The record of a file written at :meth:`path`, made and stored."""
        if now is None:
            now = self._clock()
        ttl = self.retention_s if expires_after_s is None else expires_after_s
        rec = FileRecord(file_id, size, now, filename, purpose, now + ttl)
        self.create(rec)
        return rec

    def get(self, file_id: str) -> FileRecord | None:
        if not valid_file_id(file_id):
            return None
        h = self.r.hgetall(_KEY + file_id)
        return FileRecord.from_hash(h) if h else None

    def list(self, *, after: str | None = None, limit: int = 10_000, order: str = "desc",
             purpose: str | None = None) -> tuple[list[FileRecord], bool] | None:
        """A page of records and whether more follow; None when ``after`` names no file."""
        return page(self.r, INDEX, after=after, limit=limit, desc=order == "desc",
                    load=lambda ids: [FileRecord.from_hash(h) if h else None for h in hgetalls(self.r, _KEY, ids)],
                    keep=lambda rec: purpose is None or rec.purpose == purpose)

    def delete(self, file_id: str) -> bool:
        if not valid_file_id(file_id):
            return False
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(_KEY + file_id)
        pipe.zrem(INDEX, file_id)
        pipe.zrem(EXPIRY, file_id)
        existed = bool(pipe.execute()[0])
        with contextlib.suppress(FileNotFoundError):
            self.path(file_id).unlink()
        return existed

    def sweep(self, now: float | None = None, limit: int = 500) -> list[str]:
        """Delete the files whose ``expires_at`` has passed, and uploads left half-written by
        a process that died; returns the ids deleted."""
        if now is None:
            now = self._clock()
        ids = [_s(i) for i in self.r.zrangebyscore(EXPIRY, "-inf", now, start=0, num=limit)]
        for file_id in ids:
            self.delete(file_id)
        if self.files_dir.is_dir():
            for part in self.files_dir.glob("*.part"):
                with contextlib.suppress(FileNotFoundError):
                    if part.stat().st_mtime < now - PART_MAX_AGE_S:
                        part.unlink()
        return ids


def _s(v: Any) -> Any:
    return v.decode() if isinstance(v, bytes) else v
