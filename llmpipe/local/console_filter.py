"""Which of a child's output lines ``llmpipe up`` shows on the console.

By default only warnings and errors (the log files keep everything; ``--verbose`` shows
everything). A line's level is read from the formats our children write:

* Celery:   ``[2026-11-30 11:25:37,123: WARNING/MainProcess] message``. What a worker's
  libraries print is logged this way too, at INFO (celeryconfig.py), and keeps its own
  level in the message: vLLM's ``(EngineCore pid=12) WARNING 11-30 11:25:37 [core.py:10] ...``
* uvicorn:  ``WARNING:  ...``; Flower (tornado): ``[W 261130 11:25:37 web:1] ...``; torch: ``W1130 ...``;
  Python warnings: ``file.py:12: SomeWarning: ...``
* ``llmpipe: ...`` lines (a worker that cannot start says why) always show.

A line that starts no record (a traceback's frames, an indented continuation, the
exception's last line) takes the level of the line before it, so an error shows with its
traceback; any other line without a level (a progress bar) is INFO.
"""

from __future__ import annotations

import logging
import re

_LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING, "WARN": logging.WARNING,
           "ERROR": logging.ERROR, "CRITICAL": logging.CRITICAL, "FATAL": logging.CRITICAL}
_L = "DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL"
_CELERY = re.compile(rf"^\[\d{{4}}-\d\d-\d\d [^\]]*?: ({_L})/[^\]]*\] ?(.*)$")
# Levels inside a message: vLLM's "(Name pid=N) LEVEL mm-dd", uvicorn's "LEVEL:", plain "LEVEL ".
_INNER = [re.compile(rf"^\([^)]*pid=\d+\) ({_L}) "), re.compile(rf"^({_L}):\s"), re.compile(rf"^({_L}) \d\d-\d\d ")]
_TORNADO = re.compile(r"^\[?([DIWEC])(?: \d{6} |\d{4} )")  # also glog (torch's C++): "W1130 11:42:12.962 ..."
_TORNADO_LEVELS = {"D": logging.DEBUG, "I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR, "C": logging.CRITICAL}
_PY_WARNING = re.compile(r"^\S.*:\d+: \w*Warning: ")
_EXCEPTION = re.compile(r"^[\w.]+(Error|Exception|Interrupt|Exit)\b(:|$)")


class LevelFilter:
    """Stateful per child: call ``show(line)`` for each line, in order."""

    def __init__(self, min_level: int = logging.WARNING):
        self.min_level = min_level
        self._last = logging.INFO

    def _message_level(self, text: str) -> int | None:
        """The level a message states itself, or None; -1: it continues the line before."""
        if text.startswith("llmpipe:") or text.startswith("Traceback (most recent call last)"):
            return logging.ERROR
        if _PY_WARNING.match(text):
            return logging.WARNING
        if t := _TORNADO.match(text):
            return _TORNADO_LEVELS[t.group(1)]
        for pattern in _INNER:
            m = pattern.match(text)
            if m:
                return _LEVELS[m.group(1)]
        if not text.strip() or text[0].isspace() or _EXCEPTION.match(text):
            return -1
        return None

    def level_of(self, line: str) -> int:
        m = _CELERY.match(line)
        text = m.group(2) if m else line
        own = self._message_level(text)
        if own == -1:
            return self._last
        if own is not None:
            return own
        return _LEVELS[m.group(1)] if m else logging.INFO  # a plain print (a progress bar)

    def show(self, line: str) -> bool:
        self._last = level = self.level_of(line)
        return level >= self.min_level
