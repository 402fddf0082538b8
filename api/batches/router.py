"""OpenAI's Files and Batches endpoints: ``/v1/files`` (upload, list, retrieve, content,
delete) and ``/v1/batches`` (create, list, retrieve, cancel), as the ``openai`` client calls
them. Error statuses are documented from api/openapi.py ROUTE_ERRORS."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse

from api.batches.protocol import Batch, BatchCreate, BatchList, FileDeleted, FileList, FileObject
from api.deps import Batches
from api.security import require_key

router = APIRouter(prefix="/v1", tags=["batches"], dependencies=[Depends(require_key)])

_UPLOAD = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"],
    "properties": {
        "file": {"type": "string", "format": "binary",
                 "description": "The JSONL file: one request per line; at most batch_max_file_bytes (200 MB)."},
        "purpose": {"type": "string", "enum": ["batch"]},
        "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
        "expires_after[seconds]": {"type": "integer", "minimum": 3600, "maximum": 2592000},
    }}}}}}
_CONTENT = {200: {"description": "The file's bytes.",
                  "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}

After = Annotated[str | None, Query(max_length=100, description="A cursor: the id of the last object of the page before.")]


@router.post("/files", response_model=FileObject, openapi_extra=_UPLOAD)
async def upload_file(request: Request, api: Batches) -> FileObject:
    """Upload a batch's input (multipart: ``file`` and ``purpose=batch``), written to disk as it streams in."""
    return await api.upload(request)


@router.get("/files", response_model=FileList)
def list_files(api: Batches, after: After = None, limit: int = Query(10_000, ge=1, le=10_000),
               order: Literal["asc", "desc"] = "desc",
               purpose: Literal["batch", "batch_output"] | None = None) -> FileList:
    """Files, newest first (``order=asc``: oldest first), ``limit`` a page."""
    return api.list_files(after=after, limit=limit, order=order, purpose=purpose)


@router.get("/files/{file_id}", response_model=FileObject)
def retrieve_file(file_id: str, api: Batches) -> FileObject:
    return FileObject.of(api.file(file_id))


@router.get("/files/{file_id}/content", response_class=FileResponse, responses=_CONTENT)
def file_content(file_id: str, api: Batches) -> FileResponse:
    """The file's contents: an input file as uploaded, or a batch's output or error file (JSONL)."""
    path, rec = api.content(file_id)
    return FileResponse(path, media_type="application/octet-stream", filename=rec.filename)


@router.delete("/files/{file_id}", response_model=FileDeleted)
def delete_file(file_id: str, api: Batches) -> FileDeleted:
    """Delete a file: its contents and record. A batch reading it keeps its own copy."""
    return api.delete_file(file_id)


@router.post("/batches", response_model=Batch)
def create_batch(body: BatchCreate, api: Batches) -> Batch:
    """A batch of the input file's requests, each run as a job in the batch lane; it starts ``validating``."""
    return api.create(body)


@router.get("/batches", response_model=BatchList)
def list_batches(api: Batches, after: After = None, limit: int = Query(20, ge=1, le=100)) -> BatchList:
    """Batches, newest first."""
    return api.list_batches(after=after, limit=limit)


@router.get("/batches/{batch_id}", response_model=Batch)
def retrieve_batch(batch_id: str, api: Batches) -> Batch:
    return api.batch(batch_id)


@router.post("/batches/{batch_id}/cancel", response_model=Batch)
def cancel_batch(batch_id: str, api: Batches) -> Batch:
    """Cancel: feeding stops, the lines in flight are aborted, the batch ends ``cancelled`` with
    the lines that finished in its output file and the others in its error file (``batch_cancelled``).
    A batch that is finalizing or has ended is answered as it is."""
    return api.cancel(batch_id)
