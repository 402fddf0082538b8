"""``POST /v1/files``: a multipart upload, parsed as it streams in and written to disk in chunks.

FastAPI's ``UploadFile`` would first spool the whole body to a temporary file and only then
call the handler; here python-multipart's push parser takes the body chunk by chunk, the
file part goes to its storage file as it arrives (buffered to ``FLUSH_BYTES``, written
from a thread), and an upload over ``batch_max_file_bytes`` is refused with 413 the moment
it passes the limit, its partial file deleted. The form's other fields (``purpose``,
``expires_after[anchor]``, ``expires_after[seconds]``) are small and kept in memory.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import Request

from api.errors import PayloadTooLargeError
from llmpipe.batches.files import TooLarge, Upload
from llmpipe.errors import BadRequestError

FLUSH_BYTES = 1 << 20
MAX_FIELD_BYTES = 1024  # a form field other than the file
MAX_FILENAME = 255


@dataclass
class Form:
    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    size: int = 0


@dataclass
class _Part:
    name: str | None = None
    filename: str | None = None
    value: bytearray = field(default_factory=bytearray)


class _Parser:
    """The parser's callbacks: headers of each part, then its data, to ``Form`` or the file."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.form = Form()
        self.part = _Part()
        self.header_field = bytearray()
        self.header_value = bytearray()
        self.headers: dict[str, bytes] = {}
        self.file_data = bytearray()  # file bytes not written yet
        self.in_file = False

    def callbacks(self) -> dict:
        return {"on_part_begin": self._begin, "on_header_field": self._hfield, "on_header_value": self._hvalue,
                "on_header_end": self._hend, "on_headers_finished": self._headers_done, "on_part_data": self._data,
                "on_part_end": self._end}

    def _begin(self) -> None:
        self.part, self.headers = _Part(), {}

    def _hfield(self, data: bytes, start: int, end: int) -> None:
        self.header_field += data[start:end]

    def _hvalue(self, data: bytes, start: int, end: int) -> None:
        self.header_value += data[start:end]

    def _hend(self) -> None:
        self.headers[self.header_field.decode("latin-1").lower()] = bytes(self.header_value)
        self.header_field.clear()
        self.header_value.clear()

    def _headers_done(self) -> None:
        _, opts = parse_options_header(self.headers.get("content-disposition", b""))
        name, filename = opts.get(b"name"), opts.get(b"filename")
        self.part.name = name.decode("utf-8", "replace") if name is not None else None
        self.part.filename = filename.decode("utf-8", "replace") if filename is not None else None
        self.in_file = self.part.name == "file"
        if self.in_file:
            if self.form.filename is not None:
                raise BadRequestError("the form holds more than one file part", param="file")
            self.form.filename = (self.part.filename or "upload.jsonl")[:MAX_FILENAME]

    def _data(self, data: bytes, start: int, end: int) -> None:
        if self.in_file:
            self.form.size += end - start
            if self.form.size > self.max_bytes:
                raise TooLarge(self.max_bytes)
            self.file_data += data[start:end]
            return
        self.part.value += data[start:end]
        if len(self.part.value) > MAX_FIELD_BYTES:
            raise BadRequestError(f"the form field {self.part.name!r} is over {MAX_FIELD_BYTES} bytes",
                                  param=self.part.name)

    def _end(self) -> None:
        if not self.in_file and self.part.name is not None:
            self.form.fields[self.part.name] = self.part.value.decode("utf-8", "replace")
        self.in_file = False


async def receive(request: Request, upload: Upload, io: Callable[..., Awaitable]) -> Form:
    """Parse the multipart body of ``request``, writing its ``file`` part through ``upload``
    (its blocking writes run through ``io``); the form once whole. The caller commits or
    aborts the upload."""
    mime, opts = parse_options_header(request.headers.get("content-type", ""))
    boundary = opts.get(b"boundary")
    if mime != b"multipart/form-data" or not boundary:
        raise BadRequestError("upload a file as multipart/form-data with the fields `file` and `purpose`", param="file")
    p = _Parser(upload.max_bytes)
    parser = MultipartParser(boundary, p.callbacks())
    try:
        async for chunk in request.stream():
            parser.write(chunk)
            if len(p.file_data) >= FLUSH_BYTES:
                await _flush(p, upload, io)
        parser.finalize()
        await _flush(p, upload, io)
    except TooLarge as exc:
        raise PayloadTooLargeError(f"the file is over {exc.limit} bytes (batch_max_file_bytes)", param="file") from None
    except MultipartParseError as exc:
        raise BadRequestError(f"the multipart body cannot be read: {exc}", param="file") from None
    if p.form.filename is None:
        raise BadRequestError("the form has no `file` part", param="file")
    return p.form


async def _flush(p: _Parser, upload: Upload, io: Callable[..., Awaitable]) -> None:
    if p.file_data:
        data = bytes(p.file_data)
        p.file_data.clear()
        await io(upload.write, data)
