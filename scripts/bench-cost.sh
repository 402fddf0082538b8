#!/usr/bin/env bash
# Issue 11's before/after (docs/benchmarks.md, "Per-request cost against the celery floor"):
# the celery floor and the pipeline on the no-op engine, run on the code of a git ref
# ("before", with this tree's benchmark, which has the floor) and on this tree ("after", with
# task events on and off), then the table and plot of llmpipe/bench/compare.py.
#   scripts/bench-cost.sh [REF] [OUT]      (default: 83c7f71, the last commit before issue 11; bench-results/cost)
set -euo pipefail
REF=${1:-83c7f71}
OUT=$(mkdir -p "${2:-bench-results/cost}" && cd "${2:-bench-results/cost}" && pwd)
PY=${PYTHON:-python}
ARGS=(--engine noop --modes celery-floor,pipeline-window50 --concurrency 1,64)
root=$(git rev-parse --show-toplevel)
before=$(mktemp -d)
trap 'rm -rf "$before"' EXIT
git -C "$root" archive "$REF" | tar -x -C "$before"
rm -rf "$before/llmpipe/bench" && cp -r "$root/llmpipe/bench" "$before/llmpipe/bench"
(cd "$before" && PYTHONPATH="$before" "$PY" -m llmpipe.cli bench "${ARGS[@]}" --out "$OUT/before")
(cd "$root" && PYTHONPATH="$root" "$PY" -m llmpipe.cli bench "${ARGS[@]}" --out "$OUT/after")
(cd "$root" && LLMPIPE_TASK_EVENTS=false PYTHONPATH="$root" "$PY" -m llmpipe.cli bench "${ARGS[@]}" --out "$OUT/after-events-off")
cd "$root" && PYTHONPATH="$root" "$PY" -m llmpipe.bench.compare "before=$OUT/before" "after=$OUT/after" \
  "after-events-off=$OUT/after-events-off" --out "$OUT"
