"""The kill-matrix table of docs/reliability.md from the rows the reliability tests wrote.

    LLMPIPE_RELIABILITY_OUT=rows.json pytest tests/reliability/test_kill_matrix.py
    python scripts/kill_matrix_table.py rows.json [more.json ...]

Prints a Markdown table, one line per kill, every figure from the rows (nothing typed in).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HEAD = ("| Kill (`kill -9`, 40 jobs in flight) | Broker | Completed | Lost | Engine runs > 1 / result writes > 1 "
        "| Held / back in queue | Killed process serving again | Last job done after the kill | Bound (5 s + engine restart) "
        "| Load (1 min) at the kill | Peak memory |")


def rows(paths: list[str]) -> list[dict]:
    out = []
    for p in paths:
        out += [r for r in json.loads(Path(p).read_text()) if "broker" in r and "`llmpipe up`" in r["scenario"]]
    return out


def line(r: dict) -> str:
    kill = r["scenario"].split(" (", 1)[0].removeprefix("kill -9 ")
    held = "-" if r.get("messages_held") is None else f"{r['messages_held']} / {r['swept_after_s']} s"
    return (f"| {kill} | {r['broker']} | {r['completed']} of {r['sent']} | {r['lost']} "
            f"| {r['engine_completions_gt1']} / {r['result_writes_gt1']} | {held} | {r['restart_s']} s "
            f"| {r['recovery_s']} s | {r['bound_s']} s | {r.get('load_1m_at_kill', '?')} on {r.get('cores', '?')} cores "
            f"| {round(r['peak_rss_mb'])} MB |")


def main(argv: list[str]) -> int:
    found = rows(argv)
    if not found:
        print("no kill-matrix rows in " + ", ".join(argv), file=sys.stderr)
        return 1
    print(HEAD)
    print("|" + "---|" * HEAD.count(" | ") + "---|")
    for r in found:
        print(line(r))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
