"""`llmpipe up` as a user runs it: a real subprocess on the tiny model with an embedded
Redis. It serves through the API and `llmpipe chat`, Flower (behind basic auth) lists the
three worker kinds and the inference tasks, Ctrl-C stops it warm with no process left, and
a child killed with SIGKILL comes back while the stack stays up. (Ctrl-C in the middle of
work: test_up_ctrl_c.py; startup errors: test_up_errors.py.)"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import httpx
import pytest

from llmpipe.local.placement import WATCHER_NICE, affinity, engine_cpus
from llmpipe.local.redis_server import redis_answers
from llmpipe.local.supervisor import alive, descendants
from tests.harness.clients import job_result, submit_job
from tests.harness.up import QUESTION, cmdline, flower_json, one_process, run_chat, wait_text


@pytest.mark.integration
def test_up_serves_then_stops_clean(tmp_path, ups, tiny_model):
    up = ups(tmp_path / "state", "--model", tiny_model, "--engine", "transformers", "--redis-url", "embedded",
             "--cpu-workers", "1")
    up.wait_ready()
    assert "redis: embedded redis-server at redis://127.0.0.1:" in up.err
    assert f"curl -s {up.url}/v1/jobs" in up.out and f"chat --url {up.url}" in up.out
    redis_url = re.search(r"Redis +(redis://\S+)", up.out).group(1)
    redis_pids = [p for p in up.collect() if "redis-server" in cmdline(p)]
    assert len(redis_pids) == 1

    # Through the API, with the long-poll...
    view = job_result(up.url, submit_job(up.url, {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 16,
                                         "temperature": 0}))
    assert view["status"] == "succeeded", view
    assert len(view["result"]["results"]) == 1
    # ... and through `llmpipe chat`.
    chat = run_chat(up.url)
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.strip() == view["result"]["results"][0]["text"].strip()  # greedy: the same answer
    as_json = run_chat(up.url, "--json")
    assert as_json.returncode == 0 and json.loads(as_json.stdout)["status"] == "succeeded"

    # A job of several prompts (a chord: its collect task runs; a one-prompt job has none).
    assert job_result(up.url, submit_job(up.url, {"prompts": ["a", "b"], "max_tokens": 2}))["status"] == "succeeded"

    # Flower, behind basic auth: the three worker kinds and the inference tasks.
    password = re.search(r"user admin, password (\S+)", up.out).group(1)
    assert flower_json(up, "/api/workers", None).status_code == 401
    workers = flower_json(up, "/api/workers?refresh=1", ("admin", password)).json()
    assert {w.split("@")[0] for w in workers} == {f"{k}-{up.port}" for k in ("preprocess", "inference", "postprocess")}
    end = time.monotonic() + 30
    while True:
        tasks = flower_json(up, "/api/tasks", ("admin", password)).json().values()
        done = {t["name"] for t in tasks if t["state"] == "SUCCESS" and t.get("runtime") is not None}
        if {"llmpipe.preprocess", "llmpipe.inference", "llmpipe.postprocess", "llmpipe.collect"} <= done:
            break
        assert time.monotonic() < end, f"Flower does not list every stage's tasks: {tasks}"
        time.sleep(0.5)

    # Ctrl-C: a warm stop, exit 0, no process left, the embedded Redis stopped.
    t0 = time.monotonic()
    assert up.interrupt() == 0, up.err[-3000:]
    assert time.monotonic() - t0 < 60
    assert "warm shutdown" in up.err and up.err.rstrip().endswith("stopped")
    assert len(up.tree) >= 8  # 3 workers, 2 pool processes, the API, Flower, Redis
    assert up.left_alive() == []
    assert not alive(redis_pids[0]) and not redis_answers(redis_url, timeout=0.5)
    assert "Traceback" not in up.err


# -- supervision: a child killed with SIGKILL comes back, the stack stays up -------------


@pytest.mark.integration
@pytest.mark.slow
def test_up_restarts_what_is_killed(tmp_path, ups, tiny_model):
    """`kill -9` of the inference worker (vLLM, its engine core in a process of its own as
    vLLM runs by default), then of the API and of Flower: each comes back by itself after 1 s,
    said on the console, and where it ran before; no engine core is left behind; jobs succeed;
    Ctrl-C still stops it warm.
    The stack runs with `--engine-arg max_model_len=128`, which reaches vLLM (its own config
    line), bounds what the preprocess stage admits, and holds after the restart too."""
    up = ups(tmp_path / "state", "--model", tiny_model, "--engine", "vllm", "--engine-arg", "max_model_len=128",
             "--redis-url", "embedded", "--cpu-workers", "1", VLLM_ENABLE_V1_MULTIPROCESSING="1",
             LLMPIPE_MAX_BATCH_SIZE="4")
    up.wait_ready(timeout=300)
    _off_the_engine_cpus(up)
    _engine_arg_takes_effect(up)
    body = {"prompt": "once upon a time", "max_tokens": 8, "temperature": 0}
    assert job_result(up.url, submit_job(up.url, body))["status"] == "succeeded"

    inference = one_process(up, "celery", "-Q inference")
    cores = [p for p in descendants(inference) if "EngineCore" in cmdline(p)]
    assert cores, [cmdline(p) for p in descendants(inference)]
    t_kill = time.monotonic()
    os.kill(inference, signal.SIGKILL)
    wait_text(lambda: up.err, "llmpipe up: inference was killed by SIGKILL after", up)
    line = next(ln for ln in up.err.splitlines() if "inference was killed by SIGKILL" in ln)
    assert line.endswith("; restarting in 1 s (crash 1 of 5 in 300 s)"), line
    end = time.monotonic() + 10
    while any(alive(p) for p in cores):
        assert time.monotonic() < end, f"the killed worker's engine core {cores} outlived it"
        time.sleep(0.1)
    # A job sent while the worker restarts waits for it in the queue, and succeeds.
    job = submit_job(up.url, body)
    new_inference = one_process(up, "celery", "-Q inference")
    assert new_inference != inference
    assert job_result(up.url, job, timeout=240)["status"] == "succeeded"
    print(f"\ninference killed -> a job sent after it succeeded: {time.monotonic() - t_kill:.1f} s")
    assert _inference_log(up).count("max_seq_len=128,") == 2  # the restarted engine took the argument again

    api = one_process(up, "llmpipe.cli", " api ")
    t_kill = time.monotonic()
    os.kill(api, signal.SIGKILL)
    wait_text(lambda: up.err, "llmpipe up: api was killed by SIGKILL after", up)
    end = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{up.url}/healthz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < end and up.proc.poll() is None, up.err[-3000:]
        time.sleep(0.1)
    print(f"api killed -> /healthz 200 again: {time.monotonic() - t_kill:.1f} s")
    assert one_process(up, "llmpipe.cli", " api ") != api
    assert job_result(up.url, submit_job(up.url, body))["status"] == "succeeded"

    flower = one_process(up, "celery", " flower ")
    os.kill(flower, signal.SIGKILL)
    wait_text(lambda: up.err, "llmpipe up: flower was killed by SIGKILL after", up)
    assert one_process(up, "celery", " flower ") != flower  # waits for the one live Flower
    _off_the_engine_cpus(up)  # the restarted API and Flower too

    assert up.interrupt() == 0, up.err[-3000:]
    assert "warm shutdown" in up.err and up.err.rstrip().endswith("stopped")
    assert up.left_alive() == []
    assert "Traceback" not in up.err


def _off_the_engine_cpus(up) -> None:
    """llmpipe/local/placement.py: vLLM binds its forward passes to CPUs of its own, and every
    other process of the stack (the API, the CPU stages and their pools, the embedded Redis),
    each of its threads, runs on the rest; the inference worker's own process too, its engine's
    processes left where vLLM bound them."""
    host = affinity(0)
    if len(host) < 2:
        return  # one CPU: nothing to keep apart
    inference = one_process(up, "celery", "-Q inference")
    bound = engine_cpus([inference], host)
    assert bound and bound < host, bound
    mine = {affinity(int(t)) for t in os.listdir(f"/proc/{inference}/task")}
    assert mine == {host - bound}, mine  # the inference worker's own threads
    assert engine_cpus([inference], host) == bound  # its engine's, where vLLM put them
    flower = one_process(up, "celery", " flower ")
    others = {p for p in up.collect() - {up.proc.pid, inference, flower} - descendants(inference) if alive(p)}
    assert {"redis-server", "-Q preprocess", "-Q postprocess", " api "} <= {w for p in others for w in (
        "redis-server", "-Q preprocess", "-Q postprocess", " api ") if w in cmdline(p)}
    where = {p: {affinity(int(t)) for t in os.listdir(f"/proc/{p}/task")} for p in others}
    assert all(cpus == {host - bound} for cpus in where.values()), where
    # Flower only watches: on the engine's CPUs, below the forward passes.
    watcher = {(affinity(int(t)), os.getpriority(os.PRIO_PROCESS, int(t))) for t in os.listdir(f"/proc/{flower}/task")}
    assert watcher == {(bound, WATCHER_NICE)}, watcher
    listed = [",".join(map(str, sorted(c))) for c in (bound, host - bound)]
    assert (f"CPUs     vLLM computes on {listed[0]}; llmpipe's other processes run on {listed[1]} "
            f"(Flower on {listed[0]}, at nice {WATCHER_NICE})") in up.out


def _inference_log(up) -> str:
    return (up.state_dir / "logs" / "inference.log").read_text()


def _engine_arg_takes_effect(up) -> None:
    """`--engine-arg max_model_len=128` reached vLLM itself (its config line), not only our
    settings: the preprocess stage refuses a request that does not fit, and serves one that does."""
    log = _inference_log(up)
    assert log.count("max_seq_len=128,") == 1, log[-3000:]
    too_long = job_result(up.url, submit_job(up.url, {"prompt": "word " * 100, "max_tokens": 64, "temperature": 0}))
    assert too_long["status"] == "failed", too_long
    assert too_long["error"]["type"] == "context_length_exceeded"
    assert "context length of 128 tokens" in too_long["error"]["message"]
    fits = job_result(up.url, submit_job(up.url, {"prompt": "word " * 10, "max_tokens": 8, "temperature": 0,
                                                 "ignore_eos": True}))
    assert fits["status"] == "succeeded", fits
    assert fits["result"]["results"][0]["completion_tokens"] == 8
