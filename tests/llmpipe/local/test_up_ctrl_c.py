"""Ctrl-C of `llmpipe up` (a real subprocess on the tiny model, embedded Redis) in the middle
of work: a warm stop loses no queued job (they wait in Redis's AOF for the next `up`), a
second Ctrl-C forces the stop, and Ctrl-C while it is still starting stops it too; no
process is left."""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from llmpipe.local.supervisor import alive
from tests.harness.clients import job_result, submit_job
from tests.harness.up import cmdline, queued_in, wait_text


@pytest.mark.integration
@pytest.mark.slow
def test_ctrl_c_loses_no_queued_job(tmp_path, ups, tiny_model):
    state = tmp_path / "state"
    args = ("--model", tiny_model, "--engine", "transformers", "--redis-url", "embedded", "--cpu-workers", "1",
            "--no-flower")
    up = ups(state, *args)
    up.wait_ready()
    # A long request is running when Ctrl-C comes; jobs sent during the warm stop (the API
    # stops last) wait in Redis.
    long_id = submit_job(up.url, {"prompt": "once upon a time", "max_tokens": 300, "ignore_eos": True,
                            "temperature": 0, "timeout": 600})
    end = time.monotonic() + 15
    while httpx.get(f"{up.url}/v1/jobs/{long_id}").json()["status"] == "queued" and time.monotonic() < end:
        time.sleep(0.1)
    preprocess = [p for p in up.collect() if "celery" in cmdline(p) and "preprocess" in cmdline(p)]
    assert preprocess, up.err[-3000:]
    up.proc.send_signal(signal.SIGINT)
    # The preprocess worker (stopped first) has exited: jobs sent now can only wait in Redis.
    end = time.monotonic() + 60
    while any(alive(p) for p in preprocess):
        assert time.monotonic() < end, up.err[-3000:]
        time.sleep(0.05)
    queued = []
    for i in range(5):
        try:
            queued.append(submit_job(up.url, {"prompt": f"queued {i}", "max_tokens": 4, "timeout": 600}))
        except (httpx.HTTPError, AssertionError):
            break
    assert up.wait(120) == 0, up.err[-3000:]
    assert up.left_alive() == []
    assert queued, "no job was accepted during the warm stop"
    # The running request finished during the warm stop (it was collected: a job of one prompt
    # by its postprocess task, whose id is the job id).
    assert f"llmpipe.postprocess[{long_id}] succeeded" in (state / "logs" / "postprocess.log").read_text()
    # The queued ones are in the AOF.
    assert queued_in(state)["preprocess"] >= len(queued)

    again = ups(state, *args)
    again.wait_ready()
    for job_id in [long_id, *queued]:
        assert job_result(again.url, job_id)["status"] == "succeeded", job_id
    assert again.interrupt() == 0
    assert again.left_alive() == []


@pytest.mark.integration
def test_second_ctrl_c_forces(tmp_path, ups, tiny_model):
    up = ups(tmp_path / "state", "--model", tiny_model, "--engine", "transformers", "--redis-url", "embedded",
             "--cpu-workers", "1", "--no-flower")
    up.wait_ready()
    job_id = submit_job(up.url, {"prompt": "once upon a time", "max_tokens": 1500, "ignore_eos": True, "timeout": 600})
    end = time.monotonic() + 15
    while httpx.get(f"{up.url}/v1/jobs/{job_id}").json()["status"] == "queued" and time.monotonic() < end:
        time.sleep(0.1)
    up.collect()
    up.proc.send_signal(signal.SIGINT)
    wait_text(lambda: up.err, "warm shutdown", up)  # the first Ctrl-C has been taken
    t0 = time.monotonic()
    up.proc.send_signal(signal.SIGINT)
    assert up.wait(30) == 130, up.err[-3000:]
    assert time.monotonic() - t0 < 15
    assert "forcing shutdown" in up.err and up.err.rstrip().endswith("stopped (forced)")
    assert up.left_alive() == []


@pytest.mark.integration
def test_ctrl_c_while_starting(tmp_path, ups, tiny_model):
    up = ups(tmp_path / "state", "--model", tiny_model, "--engine", "transformers", "--redis-url", "embedded",
             "--cpu-workers", "1", "--no-flower")
    end = time.monotonic() + 60
    while not any("celery" in cmdline(p) for p in up.collect()):
        assert time.monotonic() < end and up.proc.poll() is None, up.err
        time.sleep(0.1)
    assert up.interrupt(60) == 130, up.err[-3000:]
    assert "llmpipe is ready" not in up.out
    assert up.left_alive() == []
