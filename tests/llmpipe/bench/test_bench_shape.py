"""The bench package's shape: no import cycle among its modules (function-level imports
included), no function over 60 lines, no file of 400 lines or more; and matplotlib (the
``[bench]`` extra) only where the plots are drawn, so a run without it still reports."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest

import llmpipe.bench

BENCH = Path(llmpipe.bench.__file__).parent
MODULES = {f"llmpipe.bench.{p.stem}": p for p in BENCH.glob("*.py") if p.stem != "__init__"}


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in MODULES}


def test_no_import_cycle_in_the_bench():
    graph = {m: _imports(p) for m, p in MODULES.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            assert state.get(n) != 1, "import cycle: " + " -> ".join([*path, m, n])
            if n not in state:
                visit(n, [*path, m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_short_functions_and_files():
    long = []
    for m, p in MODULES.items():
        text = p.read_text()
        assert len(text.splitlines()) < 400, f"{m}: {len(text.splitlines())} lines"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60:
                long.append(f"{m}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long


def test_matplotlib_is_imported_only_by_the_plots():
    users = sorted(m for m, p in MODULES.items() if "matplotlib" in {
        n.split(".")[0] for node in ast.walk(ast.parse(p.read_text()))
        for n in ([node.module or ""] if isinstance(node, ast.ImportFrom) else
                  [a.name for a in node.names] if isinstance(node, ast.Import) else [])})
    assert users == ["llmpipe.bench.plots", "llmpipe.bench.scaling_report"]


def test_without_matplotlib_the_run_still_writes_its_report(tmp_path, monkeypatch):
    from llmpipe.bench import plots, report

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert "pip install -e '.[bench]'" in plots.missing()
    with pytest.raises(ImportError):
        plots.plots({"plans": [], "rows": []}, tmp_path)
    result = {"meta": {"started": "t", "command": "llmpipe bench", "machine": "m", "versions": {}, "duration_s": 1.0,
                       "loadavg_start": "0", "loadavg_end": "0"}, "plans": [], "rows": [], "targets": []}
    files = report.write_all(result, tmp_path)
    assert set(files) == {"json", "markdown"}
    assert "matplotlib is not installed" in (tmp_path / "report.md").read_text()
    assert "pip install" in json.loads((tmp_path / "results.json").read_text())["plots"]
