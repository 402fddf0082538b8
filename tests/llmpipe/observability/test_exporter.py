"""The worker pods' metrics sidecar: it serves what other processes wrote to the folder."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx

from llmpipe.local.redis_server import free_port
from llmpipe.local.supervisor import python_env

WRITER = ("from llmpipe.observability import metrics; metrics.BATCH_SIZE.labels('tiny').observe(8); "
          "metrics.BATCH_SIZE.labels('tiny').observe(4)")


def test_serves_the_metrics_that_worker_processes_wrote(tmp_path):
    env = python_env({"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
    for _ in range(2):  # two processes, as two pool processes of one worker pod
        subprocess.run([sys.executable, "-c", WRITER], env=env, check=True, timeout=60)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llmpipe.observability.exporter", "--port", str(port), "--address",
                             "127.0.0.1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        end = time.monotonic() + 30
        while True:
            try:
                body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
                break
            except httpx.HTTPError:
                assert proc.poll() is None and time.monotonic() < end, proc.stdout.read() if proc.poll() is not None else "timeout"
                time.sleep(0.1)
        assert 'llmpipe_batch_size_requests_count{model="tiny"} 4.0' in body
        assert 'llmpipe_batch_size_requests_sum{model="tiny"} 24.0' in body
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0


def test_refuses_to_start_without_a_metrics_folder(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "llmpipe.observability.exporter", "--dir", str(tmp_path / "missing")],
                          env=python_env({}), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no metrics folder" in proc.stderr
