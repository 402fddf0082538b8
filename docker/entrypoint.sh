#!/bin/sh
# Entry point of the llmpipe images.
#   <image> worker preprocess --concurrency 4   -> llmpipe worker preprocess --concurrency 4
#   <image> api --host 0.0.0.0 --port 8000      -> llmpipe api ...
#   <image> bash                                -> bash (any other program on PATH runs as is)
# `exec` keeps the process the direct child of the container's init, so
# SIGTERM from `docker stop` reaches Celery and starts its warm shutdown.
set -eu

if [ "$(id -u)" = "0" ]; then
    echo "llmpipe-entrypoint: warning: running as root; the images are meant to run as 'llmpipe'" >&2
fi

case "${1:-}" in
    "")
        exec llmpipe --help ;;
    worker|api|flower|model|up|submit|chat|bench|-*)
        exec llmpipe "$@" ;;
esac
if command -v "$1" >/dev/null 2>&1; then
    exec "$@"
fi
exec llmpipe "$@"
