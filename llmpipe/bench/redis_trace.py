"""Where a request's Redis commands go: MONITOR while a few requests run one at a time,
each command classified by what it serves (broker, events, result backend, job store...).

Run after a load point, never during one (MONITOR slows Redis down). Background traffic
(heartbeats, polling) is measured for as long with no requests and subtracted.
"""

from __future__ import annotations

import shlex
import threading
import time
from collections import Counter
from collections.abc import Callable

QUEUES = ("preprocess", "inference", "postprocess", "collect")


def classify(command: str) -> tuple[str, str]:
    """(purpose, COMMAND) of one MONITOR line."""
    try:
        parts = shlex.split(command)
    except ValueError:
        parts = command.split()
    cmd = parts[0].upper() if parts else "?"
    return _purpose(cmd, parts), cmd


def _purpose(cmd: str, parts: list[str]) -> str:
    if cmd in ("MULTI", "EXEC"):
        return "MULTI/EXEC (pipelined transactions)"
    key = parts[1] if len(parts) > 1 else ""
    if cmd in ("EVALSHA", "EVAL") and len(parts) > 3:
        key = parts[3] if parts[2] != "0" else ""
    if cmd == "PUBLISH":
        if "celeryev" in key:
            return "worker events (PUBLISH celeryev, -E)"
        if "pidbox" in key:
            return "control (pidbox)"
        if key.startswith("celery-task-meta"):
            return "result backend: PUBLISH of results"
        return f"PUBLISH {':'.join(key.split(':')[:2])}"
    base = key.split("\x06")[0]
    if base in QUEUES or cmd in ("BRPOP", "BLPOP"):
        return "broker: task queues"
    if key.startswith("unacked"):
        return "broker: unacked bookkeeping (acks_late)"
    if key.startswith("_kombu.binding"):
        return "broker: exchange bindings"
    if "pidbox" in key:
        return "control (pidbox)"
    if key.startswith("celery-task-meta"):
        return "result backend: task results"
    if key.startswith("celery-taskset-meta") or key.startswith("chord-unlock"):
        return "result backend: chord state"
    if key.startswith("llmpipe:"):
        return f"llmpipe:{key.split(':')[1]}:*"
    return "other"


def _collect(url: str, seconds: float | None, stop: threading.Event, out: Counter, ready: threading.Event) -> None:
    from llmpipe.broker.redis_clients import connect

    r = connect(url)
    end = time.monotonic() + seconds if seconds else None
    with r.monitor() as m:
        ready.set()
        conn = m.connection
        while not stop.is_set() and (end is None or time.monotonic() < end):
            if not conn.can_read(timeout=0.2):
                continue
            cmd = m.next_command()["command"]
            if "MONITOR" not in cmd and not cmd.startswith("INFO"):
                out[classify(cmd)] += 1  # (purpose, COMMAND)
    r.close()


def trace(url: str, send: Callable[[], int], background_s: float = 2.0) -> dict:
    """Commands per request by category: ``send()`` runs the requests and returns how many."""
    bg: Counter = Counter()
    ready = threading.Event()
    _collect(url, background_s, threading.Event(), bg, ready)
    fg: Counter = Counter()
    stop, ready = threading.Event(), threading.Event()
    t = threading.Thread(target=_collect, args=(url, None, stop, fg, ready), daemon=True)
    t.start()
    ready.wait(5)
    t0 = time.monotonic()
    n = max(1, send())
    time.sleep(0.3)  # the last result's trailing commands
    stop.set()
    t.join(timeout=5)
    dt = time.monotonic() - t0
    per_cmd = {k: (fg[k] - bg.get(k, 0) * dt / background_s) / n for k in fg}
    per: dict[str, float] = {}
    cmds: dict[str, dict[str, float]] = {}
    for (purpose, cmd), v in per_cmd.items():
        if v >= 0.05:
            per[purpose] = per.get(purpose, 0.0) + v
            cmds.setdefault(purpose, {})[cmd] = round(v, 2)
    order = sorted(per, key=lambda k: -per[k])
    return {"requests": n, "per_request": {k: round(per[k], 2) for k in order},
            "commands": {k: dict(sorted(cmds[k].items(), key=lambda kv: -kv[1])) for k in order},
            "total_per_request": round(sum(per.values()), 1), "background_per_s": round(sum(bg.values()) / background_s, 1)}
