#!/usr/bin/env bash
# The design study's table on a GPU, in one command, on a machine with no network: installs
# the wheels that benchmarks/gpu/pack.sh packed into .whl/, then runs benchmarks/gpu/run.py
# (serial, pipeline-nobatch and pipeline-window50 on a random-weight Llama built on the GPU).
#
#   benchmarks/gpu/run.sh [--shape 13b|1b] [--out DIR]            # on the GPU machine
#   benchmarks/gpu/run.sh --device cpu --shape tiny --quick        # the CPU rehearsal (make test)
#
# Environment: PYTHON (default python3), LLMPIPE_WHEELS (default .whl), LLMPIPE_SITE (where
# the wheels go, default /tmp/llmpipe-site), OUT (default gpu-results; --out wins).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
WHEELS=${LLMPIPE_WHEELS:-.whl}
SITE=${LLMPIPE_SITE:-/tmp/llmpipe-site}
start=$(date +%s)

if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  echo "gpu-run: no wheels in $WHEELS: run benchmarks/gpu/pack.sh first, and carry $WHEELS" >&2
  exit 2
fi
rm -rf "$SITE"
"$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$SITE" "$WHEELS"/*.whl
# The carried wheels first, then this checkout, then what the machine has.
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
echo "gpu-run: wheels installed into $SITE in $(( $(date +%s) - start )) s" >&2

args=("$@")
case " $* " in *" --out "*) ;; *) args+=(--out "${OUT:-gpu-results}") ;; esac
exec "$PY" -m benchmarks.gpu.run "${args[@]}"
