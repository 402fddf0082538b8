"""Serves the Prometheus metrics that a pod's worker processes write to
``PROMETHEUS_MULTIPROC_DIR``, for a scraper.

``python -m llmpipe.observability.exporter --port 9100``

With Docker Compose every process shares one metrics folder and the API's ``/metrics``
aggregates them. Pods on Kubernetes share no volume, so each worker pod runs this as a
sidecar on the pod's own folder (deploy/k8s/workers.yaml). It reads the files only; it
imports neither Celery nor the engines.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading


def serve(directory: str, port: int, address: str = "0.0.0.0"):
    """Start the HTTP server in a thread; returns (server, thread)."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=directory)
    return start_http_server(port, addr=address, registry=registry)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m llmpipe.observability.exporter", description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=9100)
    ap.add_argument("--address", default="0.0.0.0")
    ap.add_argument("--dir", default=os.environ.get("PROMETHEUS_MULTIPROC_DIR"),
                    help="the metrics folder (default: PROMETHEUS_MULTIPROC_DIR)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    if not a.dir or not os.path.isdir(a.dir):
        ap.error(f"no metrics folder: {a.dir!r} (set PROMETHEUS_MULTIPROC_DIR or --dir)")
    server, _ = serve(a.dir, a.port, a.address)
    print(f"llmpipe-metrics: serving {a.dir} on {a.address}:{a.port}/metrics", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
