"""A batch's output and error files, written so that each line appears exactly once.

The feeder appends finished lines as whole JSON lines, a group at a time (one ``write`` on
an ``O_APPEND`` descriptor, then ``fsync``), and only then records the progress in Redis.
A process that takes the batch over opens the files again (:meth:`BatchOutput.open`): it
reads every line, cuts a torn last line (a write the dead process never finished) and
rebuilds the set of ``custom_id`` already written, so it feeds exactly the lines missing
from both files. :meth:`BatchOutput.write` skips a line whose ``custom_id`` is written
already. :meth:`BatchOutput.seal`, before the files are published, keeps the first
line of each ``custom_id`` across both files and drops any line that does not parse, so
even a process that stalled past its lease and woke up to append a group cannot leave a
duplicate behind.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Line:
    """A finished line: its record (the output line), whether it succeeded, and its usage."""

    custom_id: str
    record: dict
    ok: bool
    model: str = ""

    @property
    def usage(self) -> tuple[int, int]:
        return line_usage(self.record)


def line_usage(record: dict) -> tuple[int, int]:
    """(prompt, completion) tokens of a line's answer (0, 0 without one)."""
    resp = record.get("response") or {}
    body = resp.get("body") if isinstance(resp, dict) else None
    u = body.get("usage") if isinstance(body, dict) and resp.get("status_code") == 200 else None
    if not isinstance(u, dict):
        return 0, 0
    return int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)


@dataclass
class Counts:
    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0

    def add(self, line: Line) -> None:
        if line.ok:
            self.completed += 1
        else:
            self.failed += 1
        i, o = line.usage
        self.input_tokens += i
        self.output_tokens += o

    def fields(self) -> dict[str, int]:
        return {"completed": self.completed, "failed": self.failed, "input_tokens": self.input_tokens,
                "output_tokens": self.output_tokens}


class LineFile:
    """One append-only JSONL file."""

    def __init__(self, path: Path, *, fsync: bool = True):
        self.path = Path(path)
        self.fsync = fsync
        self._fd: int | None = None

    def repair(self) -> int:
        """Cut a torn last line (a write that a dead process never finished); returns the
        bytes cut."""
        if not self.path.exists():
            return 0
        with open(self.path, "r+b") as f:
            size = f.seek(0, os.SEEK_END)
            pos = size
            while pos > 0:
                step = min(64 * 1024, pos)
                f.seek(pos - step)
                chunk = f.read(step)
                nl = chunk.rfind(b"\n")
                if nl >= 0:
                    pos = pos - step + nl + 1
                    break
                pos -= step
            if pos != size:
                f.truncate(pos)
            return size - pos

    def records(self) -> Iterator[dict | None]:
        """Every whole line, read as a stream (None for one that does not parse)."""
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            for raw in f:
                if raw.endswith(b"\n"):
                    yield _parse(raw)

    def append(self, records: Iterable[dict]) -> None:
        blob = b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in records)
        if not blob:
            return
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        view = memoryview(blob)
        while view:
            view = view[os.write(self._fd, view):]
        if self.fsync:
            os.fsync(self._fd)

    def rewrite(self, keep: Callable[[dict | None], bool]) -> None:
        """Replace the file with the lines ``keep`` keeps, in order (a temporary file renamed
        over it), reading and writing as streams."""
        self.close()
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(self.path, "rb") as src, open(tmp, "wb") as dst:
            for raw in src:
                if raw.endswith(b"\n") and keep(_parse(raw)):
                    dst.write(raw)
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, self.path)

    def size(self) -> int:
        return self.path.stat().st_size if self.path.exists() else 0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@dataclass
class BatchOutput:
    output: LineFile
    errors: LineFile
    written: set[str] = field(default_factory=set)
    counts: Counts = field(default_factory=Counts)

    @classmethod
    def open(cls, output_path: Path, error_path: Path, *, fsync: bool = True) -> BatchOutput:
        """The files as a crash or a takeover left them: every ``custom_id`` written so far
        and the counts of the lines that hold them (a duplicate counts once)."""
        out = cls(LineFile(output_path, fsync=fsync), LineFile(error_path, fsync=fsync))
        for ok, lf in ((True, out.output), (False, out.errors)):
            lf.repair()
            for rec in lf.records():
                cid = rec.get("custom_id") if rec is not None else None
                if isinstance(cid, str) and cid not in out.written:
                    out.written.add(cid)
                    out.counts.add(Line(cid, rec, ok))
        return out

    def write(self, lines: list[Line]) -> list[Line]:
        """Append the lines not written yet; returns those written."""
        fresh: list[Line] = []
        for ln in lines:
            if ln.custom_id not in self.written:
                self.written.add(ln.custom_id)
                fresh.append(ln)
        self.output.append(ln.record for ln in fresh if ln.ok)
        self.errors.append(ln.record for ln in fresh if not ln.ok)
        for ln in fresh:
            self.counts.add(ln)
        return fresh

    def seal(self) -> Counts:
        """Before the files are published: the first line of each ``custom_id`` across both
        files (the output file's first), none that does not parse; the counts of what is kept."""
        self.close()
        seen: set[str] = set()
        counts = Counts()
        for ok, lf in ((True, self.output), (False, self.errors)):
            lf.repair()
            kept: set[str] = set()
            dropped = 0
            for rec in lf.records():
                cid = rec.get("custom_id") if rec is not None else None
                if isinstance(cid, str) and cid not in seen:
                    seen.add(cid)
                    kept.add(cid)
                    counts.add(Line(cid, rec, ok))
                else:
                    dropped += 1
            if dropped:
                lf.rewrite(_first_of(kept))
        self.written, self.counts = seen, counts
        return counts

    def close(self) -> None:
        self.output.close()
        self.errors.close()


def _first_of(ids: set[str]) -> Callable[[dict | None], bool]:
    """Keeps the first line of each of ``ids`` (the ones a seal pass kept), in file order."""
    left = set(ids)

    def keep(rec: dict | None) -> bool:
        cid = rec.get("custom_id") if rec is not None else None
        if isinstance(cid, str) and cid in left:
            left.discard(cid)
            return True
        return False
    return keep


def _parse(raw: bytes) -> dict | None:
    try:
        v = json.loads(raw)
    except ValueError:
        return None
    return v if isinstance(v, dict) else None
