"""A batch's input file: validated once, then read line by line as the lines are fed.

Each non-blank line of the JSONL file is one request, OpenAI's
``{"custom_id", "method": "POST", "url", "body"}``. :func:`scan` reads the file as a stream
and checks what makes the whole batch fail (OpenAI's ``validating`` step): a line that is
not JSON, or not such an object, a ``method`` other than POST, a ``url`` other than the
batch's endpoint, a ``custom_id`` that is missing or repeats one before it, more lines than
``batch_max_lines``, a file over ``batch_max_file_bytes`` or with no line at all. Each error
names its line (1-based, counting blank lines too, as an editor does). The body is checked
later, line by line, as the synchronous endpoint checks it: a line whose body is wrong fails
alone.

The scan also gives each request's byte offset, so a feeder reads line ``i`` with one seek;
a feeder that takes the batch over scans again and gets the same lines.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

MAX_CUSTOM_ID = 512  # characters
MAX_ERRORS = 100  # a failed batch lists at most this many errors (the first ones)


class InputError(StrEnum):
    """The ``code`` of an error in a failed batch's ``errors`` list."""

    INVALID_JSON_LINE = "invalid_json_line"
    INVALID_REQUEST = "invalid_request"  # not an object of custom_id, method, url and body
    DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
    INVALID_URL = "invalid_url"
    INVALID_METHOD = "invalid_method"
    TOO_MANY_LINES = "too_many_lines"
    FILE_TOO_LARGE = "file_too_large"
    EMPTY_FILE = "empty_file"
    MISSING_FILE = "missing_file"


@dataclass(frozen=True)
class InputLine:
    index: int  # 0-based among the requests
    line: int  # 1-based line number in the file
    offset: int
    custom_id: str


@dataclass
class Scan:
    lines: list[InputLine] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    models: set[str] = field(default_factory=set)  # the ``model`` the bodies name, "" for none (two at most)

    def error(self, code: InputError, message: str, line: int | None = None, param: str | None = None) -> None:
        if len(self.errors) < MAX_ERRORS:
            self.errors.append({"code": code.value, "message": message, "line": line, "param": param})


def scan(path: Path, *, endpoint: str, max_lines: int, max_bytes: int) -> Scan:
    out = Scan()
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        out.error(InputError.MISSING_FILE, "The batch's input file is gone.")
        return out
    if size > max_bytes:
        out.error(InputError.FILE_TOO_LARGE, f"The input file is {size} bytes; at most {max_bytes} "
                  "(batch_max_file_bytes).")
        return out
    first_line: dict[str, int] = {}
    with open(path, "rb") as f:
        offset, number = 0, 0
        for raw in f:
            number += 1
            at, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            if len(out.lines) >= max_lines:
                out.error(InputError.TOO_MANY_LINES, f"The input file holds more than {max_lines} requests "
                          "(batch_max_lines).", line=number)
                break
            cid = _check_line(raw, number, endpoint, out, first_line)
            if cid is not None:
                out.lines.append(InputLine(len(out.lines), number, at, cid))
    if not out.lines and not out.errors:
        out.error(InputError.EMPTY_FILE, "The input file holds no request.")
    return out


def _check_line(raw: bytes, number: int, endpoint: str, out: Scan, first_line: dict[str, int]) -> str | None:
    """The line's custom_id once it passes, else None (its error recorded)."""
    try:
        req = json.loads(raw)
    except ValueError:
        out.error(InputError.INVALID_JSON_LINE, "This line is not parseable as valid JSON.", line=number)
        return None
    if not isinstance(req, dict):
        out.error(InputError.INVALID_REQUEST, "A line must be a JSON object with custom_id, method, url and body.",
                  line=number)
        return None
    cid = req.get("custom_id")
    if not isinstance(cid, str) or not cid or len(cid) > MAX_CUSTOM_ID:
        out.error(InputError.INVALID_REQUEST, f"custom_id must be a string of 1 to {MAX_CUSTOM_ID} characters.",
                  line=number, param="custom_id")
        return None
    if req.get("method") != "POST":
        out.error(InputError.INVALID_METHOD, f"Only POST is supported; got {req.get('method')!r}.", line=number,
                  param="method")
        return None
    if req.get("url") != endpoint:
        out.error(InputError.INVALID_URL, f"The url {req.get('url')!r} does not match the batch's endpoint "
                  f"{endpoint!r}.", line=number, param="url")
        return None
    if not isinstance(req.get("body"), dict):
        out.error(InputError.INVALID_REQUEST, "body must be a JSON object (the request).", line=number, param="body")
        return None
    if cid in first_line:
        out.error(InputError.DUPLICATE_CUSTOM_ID, f"The custom_id {cid!r} is already used on line {first_line[cid]}; "
                  "each request needs its own.", line=number, param="custom_id")
        return None
    first_line[cid] = number
    model = req["body"].get("model")
    if len(out.models) < 2:
        out.models.add(model if isinstance(model, str) else "")
    return cid


def read_line(f: Any, line: InputLine) -> dict:
    """The request of ``line`` from the input file open as ``f`` (binary)."""
    f.seek(line.offset)
    return json.loads(f.readline())
