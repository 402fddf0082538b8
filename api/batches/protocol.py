"""Bodies of ``/v1/files`` and ``/v1/batches``: OpenAI's ``File`` and ``Batch`` objects, so
that the ``openai`` client reads them unchanged."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from llmpipe.batches.files import FileRecord
from llmpipe.batches.records import BatchRecord, BatchStatus

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
# OpenAI takes "24h" only; llmpipe takes any whole number of seconds, minutes or hours.
WINDOW_PATTERN = r"^[1-9][0-9]{0,5}[smh]$"
_UNIT_S = {"s": 1, "m": 60, "h": 3600}


def window_seconds(window: str) -> int:
    m = re.fullmatch(WINDOW_PATTERN, window)
    if m is None:
        raise ValueError(f"not a completion window: {window!r}")
    return int(window[:-1]) * _UNIT_S[window[-1]]


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None

    @classmethod
    def of(cls, rec: FileRecord) -> FileObject:
        return cls(id=rec.id, bytes=rec.bytes, created_at=int(rec.created_at), filename=rec.filename,
                   purpose=rec.purpose, expires_at=int(rec.expires_at))


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


_MetaKey = Annotated[str, StringConstraints(max_length=64)]
_MetaValue = Annotated[str, StringConstraints(max_length=512)]


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input_file_id: str = Field(description="A file uploaded with purpose `batch`: one request per line (JSONL).")
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    completion_window: str = Field(pattern=WINDOW_PATTERN, description=(
        "How long the batch may run: OpenAI's `24h`, or (llmpipe) any whole number of seconds, minutes or hours "
        "such as `30m`. Lines not finished by then end in the error file with code `batch_expired`."))
    metadata: Annotated[dict[_MetaKey, _MetaValue], Field(max_length=16)] | None = Field(
        default=None, description="Up to 16 key-value pairs (keys up to 64 characters, values up to 512).")


class BatchError(BaseModel):
    code: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class BatchRequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class BatchUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class Batch(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts
    usage: BatchUsage
    model: str | None = None
    metadata: dict[str, str] | None = None

    @classmethod
    def of(cls, rec: BatchRecord) -> Batch:
        return cls(
            id=rec.id, endpoint=rec.endpoint, input_file_id=rec.input_file_id,
            completion_window=rec.completion_window, status=rec.status, output_file_id=rec.output_file_id,
            error_file_id=rec.error_file_id, created_at=int(rec.created_at), expires_at=int(rec.expires_at),
            errors=BatchErrors(data=[BatchError(**e) for e in rec.errors]) if rec.errors else None,
            request_counts=BatchRequestCounts(total=rec.total, completed=rec.completed, failed=rec.failed),
            usage=BatchUsage(input_tokens=rec.input_tokens, output_tokens=rec.output_tokens,
                             total_tokens=rec.input_tokens + rec.output_tokens),
            model=rec.model, metadata=rec.metadata, **{k: int(v) for k, v in rec.times.items()})


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False
