"""The package boundaries (docs/architecture.md, "Packages"): import-linter's contracts in
pyproject.toml, and what they cannot say: the API process loads no heavy library, what
celeryconfig imports, no import cycle, no long function and no hidden first-party import in
runtime code."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("llmpipe", "api", "workers", "tasks")
FIRST_PARTY = (*PACKAGES, "celeryconfig", "benchmarks")
# Not runtime code: the benchmark and the test support (import-linter keeps runtime code
# from importing them).
NOT_RUNTIME = ("llmpipe/bench/", "llmpipe/testing/")
HEAVY = ("vllm", "torch", "transformers")
MAX_FUNCTION_LINES = 60
# A first-party import inside a function, each with its reason.
LAZY_ALLOWED = {
    # vLLM's parser classes: the module imports vLLM, which a CPU worker loads only for a
    # request whose model has parsers.
    ("llmpipe/engines/vllm_convert.py", "llmpipe.parsing.vllm_parsers"),
    ("llmpipe/processors/input_processor.py", "llmpipe.parsing.vllm_parsers"),
}


def _runtime_files() -> list[Path]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")] + [ROOT / "celeryconfig.py"]
    return [p for p in files if not str(p.relative_to(ROOT)).startswith(NOT_RUNTIME)]


def _functions(tree: ast.AST):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _first_party(node: ast.AST) -> list[str]:
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [node.module]
    elif isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        return []
    return [n for n in names if n.split(".")[0] in FIRST_PARTY]


def test_the_import_contracts_hold():
    r = subprocess.run([str(Path(sys.executable).with_name("lint-imports"))], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_the_api_process_loads_no_heavy_library():
    probe = f"import sys, api.app; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "[]"


def test_celeryconfig_imports_only_settings_names_and_broker_helpers():
    tree = ast.parse((ROOT / "celeryconfig.py").read_text())
    mods = {m for node in ast.walk(tree) for m in _first_party(node)}
    assert all(m.startswith(("llmpipe.settings", "llmpipe.stages", "llmpipe.broker.", "llmpipe.jobs.lanes"))
               for m in mods), mods


def test_no_import_cycle_among_runtime_modules():
    graph = grimp.build_graph(*PACKAGES)
    runtime = {m for m in graph.modules if not m.startswith(("llmpipe.bench", "llmpipe.testing"))}
    cycles = []
    for m in sorted(runtime):
        for other in graph.find_modules_directly_imported_by(m) & runtime:
            if other != m and graph.chain_exists(importer=other, imported=m):
                cycles.append((m, other))
    assert cycles == []


def test_no_runtime_function_is_over_60_lines():
    long = []
    for p in _runtime_files():
        for fn in _functions(ast.parse(p.read_text())):
            n = fn.end_lineno - fn.lineno + 1
            if n > MAX_FUNCTION_LINES:
                long.append(f"{p.relative_to(ROOT)}:{fn.lineno} {fn.name} ({n} lines)")
    assert long == []


def test_first_party_imports_are_at_the_top_of_their_module():
    hidden = set()
    for p in _runtime_files():
        rel = str(p.relative_to(ROOT))
        for fn in _functions(ast.parse(p.read_text())):
            for node in ast.walk(fn):
                hidden |= {(rel, m) for m in _first_party(node)}
    assert hidden - LAZY_ALLOWED == set()
