"""``/v1/files`` and ``/v1/batches`` on the file and batch stores (llmpipe/batches/); the feeding
itself is the runner's (api/batches/runner.py)."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from fastapi import Request

from api.batches.protocol import Batch, BatchCreate, BatchList, FileDeleted, FileList, FileObject, window_seconds
from api.batches.upload import receive
from llmpipe.batches.files import PURPOSE_BATCH, FileRecord, FileStore, batch_input_path, new_batch_id, new_file_id
from llmpipe.batches.records import BatchRecord, BatchStatus, BatchStore
from llmpipe.errors import BadRequestError, NotFoundError
from llmpipe.settings import Settings

# OpenAI's bounds on a file's own ``expires_after``.
EXPIRES_AFTER_MIN_S = 3600
EXPIRES_AFTER_MAX_S = 30 * 24 * 3600


class BatchAPI:
    def __init__(self, files: FileStore, batches: BatchStore, settings: Settings, io: Callable[..., Awaitable],
                 clock=time.time):
        self.files = files
        self.batches = batches
        self.settings = settings
        self.io = io
        self._clock = clock

    # -- files ------------------------------------------------------------------------
    async def upload(self, request: Request) -> FileObject:
        file_id = new_file_id()
        up = await self.io(self.files.upload, file_id, self.settings.batch_max_file_bytes)
        try:
            form = await receive(request, up, self.io)
            purpose = form.fields.get("purpose")
            if purpose != PURPOSE_BATCH:
                raise BadRequestError(f"purpose must be {PURPOSE_BATCH!r} (the Batch API's input); got {purpose!r}",
                                      param="purpose")
            ttl = _expires_after(form.fields)
            size = await self.io(up.commit)
        except BaseException:
            await self.io(up.abort)
            raise
        rec = await self.io(self.files.record, file_id, size, form.filename, purpose, expires_after_s=ttl)
        return FileObject.of(rec)

    def file(self, file_id: str) -> FileRecord:
        rec = self.files.get(file_id)
        if rec is None:
            raise NotFoundError(f"no file with id {file_id!r} (unknown, deleted or expired)", param="file_id")
        return rec

    def content(self, file_id: str) -> tuple[Path, FileRecord]:
        rec = self.file(file_id)
        path = self.files.path(rec.id)
        if not path.is_file():
            raise NotFoundError(f"the contents of file {file_id!r} are gone", param="file_id")
        return path, rec

    def list_files(self, *, after: str | None, limit: int, order: str, purpose: str | None) -> FileList:
        got = self.files.list(after=after, limit=limit, order=order, purpose=purpose)
        if got is None:
            raise NotFoundError(f"after: no file with id {after!r} (unknown, deleted or expired)", param="after")
        recs, more = got
        data = [FileObject.of(r) for r in recs]
        return FileList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                        has_more=more)

    def delete_file(self, file_id: str) -> FileDeleted:
        self.file(file_id)
        return FileDeleted(id=file_id, deleted=self.files.delete(file_id))

    # -- batches ----------------------------------------------------------------------
    def create(self, body: BatchCreate) -> Batch:
        src = self.files.get(body.input_file_id)
        if src is None:
            raise NotFoundError(f"no file with id {body.input_file_id!r} (unknown, deleted or expired)",
                                param="input_file_id")
        if src.purpose != PURPOSE_BATCH:
            raise BadRequestError(f"file {src.id} has purpose {src.purpose!r}; a batch reads a file of purpose "
                                  f"{PURPOSE_BATCH!r}", param="input_file_id")
        now = self._clock()
        batch_id = new_batch_id()
        _link(self.files.path(src.id), batch_input_path(self.files.root, batch_id))
        rec = BatchRecord(id=batch_id, status=BatchStatus.VALIDATING, endpoint=body.endpoint,
                          input_file_id=src.id, completion_window=body.completion_window, created_at=now,
                          expires_at=now + window_seconds(body.completion_window), metadata=body.metadata)
        self.batches.create(rec)
        return Batch.of(rec)

    def batch(self, batch_id: str) -> Batch:
        rec = self.batches.get(batch_id)
        if rec is None:
            raise NotFoundError(f"no batch with id {batch_id!r} (unknown or expired)", param="batch_id")
        return Batch.of(rec)

    def list_batches(self, *, after: str | None, limit: int) -> BatchList:
        got = self.batches.list(after=after, limit=limit)
        if got is None:
            raise NotFoundError(f"after: no batch with id {after!r} (unknown or expired)", param="after")
        recs, more = got
        data = [Batch.of(r) for r in recs]
        return BatchList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                         has_more=more)

    def cancel(self, batch_id: str) -> Batch:
        """A batch validating or in progress starts cancelling (its feeder stops it); one that
        is finalizing or has ended is answered as it is."""
        self.batch(batch_id)
        self.batches.cancel(batch_id)
        return self.batch(batch_id)


def _expires_after(fields: dict[str, str]) -> float | None:
    """OpenAI's ``expires_after`` of an upload, in seconds after its creation (the only anchor,
    ``created_at``, may be left out); None: the retention."""
    anchor, seconds = fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]")
    if anchor is not None and anchor != "created_at":
        raise BadRequestError("expires_after[anchor] must be 'created_at'", param="expires_after[anchor]")
    if seconds is None:
        return None
    if not seconds.isdigit() or not EXPIRES_AFTER_MIN_S <= int(seconds) <= EXPIRES_AFTER_MAX_S:
        raise BadRequestError(f"expires_after[seconds] must be a whole number from {EXPIRES_AFTER_MIN_S} to "
                              f"{EXPIRES_AFTER_MAX_S}", param="expires_after[seconds]")
    return float(seconds)


def _link(src: Path, dst: Path) -> None:
    """The batch's own name for its input file: a hard link (no copy), or a copy where the
    storage cannot link."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        dst.unlink()
    try:
        os.link(src, dst)
    except FileNotFoundError:
        raise NotFoundError(f"the contents of file {src.stem!r} are gone", param="input_file_id") from None
    except OSError:
        shutil.copyfile(src, dst)
