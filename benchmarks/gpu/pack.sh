#!/usr/bin/env bash
# Packs what benchmarks/gpu/run.sh needs on a GPU machine with no network: the wheels of
# benchmarks/gpu/wheels.txt for Python 3.12 manylinux x86_64 into .whl/ (ignored by git),
# checks that their requirements are met by each other or by that machine's packages,
# checks that everything that travels is under 64 MiB, and prints the carry list.
#   benchmarks/gpu/pack.sh [--relock] [--dest DIR] [--python-version 3.12]
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m benchmarks.gpu.pack "$@"
