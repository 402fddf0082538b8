"""`llmpipe up` as a user runs it: a real subprocess on the tiny model with an embedded
Redis. It serves through the API and `llmpipe chat`, Flower (behind basic auth) lists the
three worker kinds and the inference tasks, Ctrl-C stops it warm with no process left and
no queued job lost, and startup errors end in one line and a non-zero exit."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from llmpipe.redis_server import EmbeddedRedis, free_port, redis_answers
from llmpipe.supervisor import alive, descendants

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "llmpipe.cli"]
QUESTION = "What is the capital of France?"


def _env(state_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMPIPE_")}
    return {**env, "LLMPIPE_STATE_DIR": str(state_dir), "HF_HUB_OFFLINE": "1", **extra}


class Up:
    """One `llmpipe up` subprocess, its output files, and every process it ever had."""

    def __init__(self, state_dir: Path, *args: str, **env: str):
        self.state_dir = state_dir
        self.port = free_port()
        self.flower_port = free_port()
        state_dir.mkdir(parents=True, exist_ok=True)
        n = len(list(state_dir.glob("up-*.out")))
        self.out_path, self.err_path = state_dir / f"up-{n}.out", state_dir / f"up-{n}.err"
        with self.out_path.open("w") as out, self.err_path.open("w") as err:
            self.proc = subprocess.Popen(
                [*CLI, "up", "--port", str(self.port), "--flower-port", str(self.flower_port), *args],
                cwd=ROOT, env=_env(state_dir, **env), stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        self.tree: set[int] = set()
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def out(self) -> str:
        return self.out_path.read_text()

    @property
    def err(self) -> str:
        return self.err_path.read_text()

    def collect(self) -> set[int]:
        if self.proc.poll() is None:
            self.tree |= descendants(self.proc.pid)
        return self.tree

    def wait_ready(self, timeout: float = 240) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.collect()
            if "llmpipe is ready" in self.out:
                assert httpx.get(f"{self.url}/healthz", timeout=5).status_code == 200
                self.collect()
                return
            assert self.proc.poll() is None, f"llmpipe up exited {self.proc.returncode}:\n{self.err[-3000:]}"
            time.sleep(0.3)
        raise AssertionError(f"not ready after {timeout}s:\n{self.err[-3000:]}")

    def wait(self, timeout: float) -> int:
        end = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < end:
            self.collect()
            time.sleep(0.2)
        return self.proc.wait(max(0.1, end - time.monotonic()))

    def interrupt(self, timeout: float = 120) -> int:
        self.collect()
        self.proc.send_signal(signal.SIGINT)
        return self.wait(timeout)

    def left_alive(self, grace: float = 5.0) -> list[str]:
        end = time.monotonic() + grace
        while time.monotonic() < end and any(alive(p) for p in self.tree):
            time.sleep(0.1)
        return [f"{p}: {_cmdline(p)}" for p in sorted(self.tree) if alive(p)]

    def kill(self) -> None:
        for pid in [self.proc.pid, *self.collect()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.wait(10)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "?"


@pytest.fixture
def ups():
    started: list[Up] = []

    def start(*args, **kw) -> Up:
        up = Up(*args, **kw)
        started.append(up)
        return up

    yield start
    for up in started:
        if up.proc.poll() is None:
            up.kill()


def _job(url: str, body: dict) -> str:
    r = httpx.post(f"{url}/v1/jobs", json=body, timeout=10)
    assert r.status_code == 202, r.text
    return r.json()["id"]


def _result(url: str, job_id: str, timeout: float = 120) -> dict:
    end = time.monotonic() + timeout
    while True:
        view = httpx.get(f"{url}/v1/jobs/{job_id}", params={"wait": 10}, timeout=30).json()
        if view["status"] not in ("queued", "running") or time.monotonic() > end:
            return view
        time.sleep(0.1)


def _chat(url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "chat", "--url", url, "--max-tokens", "16", *args, QUESTION],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def _flower_json(up: Up, path: str, auth) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{up.flower_port}{path}", auth=auth, timeout=30)


@pytest.mark.integration
def test_up_serves_then_stops_clean(tmp_path, ups, tiny_model):
    up = ups(tmp_path / "state", "--model", tiny_model, "--engine", "transformers", "--redis-url", "embedded",
             "--cpu-workers", "1")
    up.wait_ready()
    assert f"redis: embedded redis-server at redis://127.0.0.1:" in up.err
    assert f"curl -s {up.url}/v1/jobs" in up.out and f"chat --url {up.url}" in up.out
    redis_url = re.search(r"Redis +(redis://\S+)", up.out).group(1)
    redis_pids = [p for p in up.collect() if "redis-server" in _cmdline(p)]
    assert len(redis_pids) == 1

    # Through the API, with the long-poll...
    view = _result(up.url, _job(up.url, {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 16,
                                         "temperature": 0}))
    assert view["status"] == "succeeded", view
    assert len(view["result"]["results"]) == 1
    # ... and through `llmpipe chat`.
    chat = _chat(up.url)
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.strip() == view["result"]["results"][0]["text"].strip()  # greedy: the same answer
    as_json = _chat(up.url, "--json")
    assert as_json.returncode == 0 and json.loads(as_json.stdout)["status"] == "succeeded"

    # A job of several prompts (a chord: its collect task runs; a one-prompt job has none).
    assert _result(up.url, _job(up.url, {"prompts": ["a", "b"], "max_tokens": 2}))["status"] == "succeeded"

    # Flower, behind basic auth: the three worker kinds and the inference tasks.
    password = re.search(r"user admin, password (\S+)", up.out).group(1)
    assert _flower_json(up, "/api/workers", None).status_code == 401
    workers = _flower_json(up, "/api/workers?refresh=1", ("admin", password)).json()
    assert {w.split("@")[0] for w in workers} == {f"{k}-{up.port}" for k in ("preprocess", "inference", "postprocess")}
    end = time.monotonic() + 30
    while True:
        tasks = _flower_json(up, "/api/tasks", ("admin", password)).json().values()
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


def _wait_text(read, text: str, up: Up, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while text not in read():
        assert time.monotonic() < end and up.proc.poll() is None, f"no {text!r}:\n{up.err[-3000:]}"
        time.sleep(0.05)


def _queued_in(state_dir: Path) -> dict[str, int]:
    """Messages waiting in each stage queue of the stopped pipeline's AOF."""
    with EmbeddedRedis(state_dir / "redis") as server:
        import redis

        r = redis.Redis.from_url(server.url)
        try:
            return {q: sum(r.llen(k) for k in r.keys(f"{q}*") if r.type(k) == b"list")
                    for q in ("preprocess", "inference", "postprocess", "collect")}
        finally:
            r.close()


@pytest.mark.integration
def test_ctrl_c_loses_no_queued_job(tmp_path, ups, tiny_model):
    state = tmp_path / "state"
    args = ("--model", tiny_model, "--engine", "transformers", "--redis-url", "embedded", "--cpu-workers", "1",
            "--no-flower")
    up = ups(state, *args)
    up.wait_ready()
    # A long request is running when Ctrl-C comes; jobs sent during the warm stop (the API
    # stops last) wait in Redis.
    long_id = _job(up.url, {"prompt": "once upon a time", "max_tokens": 300, "ignore_eos": True,
                            "temperature": 0, "timeout": 600})
    end = time.monotonic() + 15
    while httpx.get(f"{up.url}/v1/jobs/{long_id}").json()["status"] == "queued" and time.monotonic() < end:
        time.sleep(0.1)
    preprocess = [p for p in up.collect() if "celery" in _cmdline(p) and "preprocess" in _cmdline(p)]
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
            queued.append(_job(up.url, {"prompt": f"queued {i}", "max_tokens": 4, "timeout": 600}))
        except (httpx.HTTPError, AssertionError):
            break
    assert up.wait(120) == 0, up.err[-3000:]
    assert up.left_alive() == []
    assert queued, "no job was accepted during the warm stop"
    # The running request finished during the warm stop (it was collected: a job of one prompt
    # by its postprocess task, whose id is the job id).
    assert f"llmpipe.postprocess[{long_id}] succeeded" in (state / "logs" / "postprocess.log").read_text()
    # The queued ones are in the AOF.
    assert _queued_in(state)["preprocess"] >= len(queued)

    again = ups(state, *args)
    again.wait_ready()
    for job_id in [long_id, *queued]:
        assert _result(again.url, job_id)["status"] == "succeeded", job_id
    assert again.interrupt() == 0
    assert again.left_alive() == []


@pytest.mark.integration
def test_second_ctrl_c_forces(tmp_path, ups, tiny_model):
    up = ups(tmp_path / "state", "--model", tiny_model, "--engine", "transformers", "--redis-url", "embedded",
             "--cpu-workers", "1", "--no-flower")
    up.wait_ready()
    job_id = _job(up.url, {"prompt": "once upon a time", "max_tokens": 1500, "ignore_eos": True, "timeout": 600})
    end = time.monotonic() + 15
    while httpx.get(f"{up.url}/v1/jobs/{job_id}").json()["status"] == "queued" and time.monotonic() < end:
        time.sleep(0.1)
    up.collect()
    up.proc.send_signal(signal.SIGINT)
    _wait_text(lambda: up.err, "warm shutdown", up)  # the first Ctrl-C has been taken
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
    while not any("celery" in _cmdline(p) for p in up.collect()):
        assert time.monotonic() < end and up.proc.poll() is None, up.err
        time.sleep(0.1)
    assert up.interrupt(60) == 130, up.err[-3000:]
    assert "llmpipe is ready" not in up.out
    assert up.left_alive() == []


# -- startup errors: one line, a non-zero exit, no hang ---------------------------------


def _run_up(tmp_path, *args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "up", "--no-flower", *args], cwd=ROOT, env=_env(tmp_path / "state", **env),
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def _error_line(result: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("llmpipe up: ")]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def test_port_in_use(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.monotonic()
        result = _run_up(tmp_path, "--port", str(port), "--redis-url", "embedded")
    assert result.returncode != 0 and time.monotonic() - t0 < 30
    assert f"port {port} for the API is already in use" in _error_line(result)


def test_missing_model_path(tmp_path):
    result = _run_up(tmp_path, "--port", str(free_port()), "--model", str(tmp_path / "no-such-model"),
                     "--redis-url", "embedded")
    assert result.returncode != 0
    assert "does not exist" in _error_line(result)


def test_explicit_redis_that_does_not_answer(tmp_path):
    result = _run_up(tmp_path, "--port", str(free_port()), "--redis-url", f"redis://127.0.0.1:{free_port()}/0")
    assert result.returncode != 0
    assert "does not answer" in _error_line(result)


@pytest.mark.integration
def test_engine_that_cannot_start(tmp_path, ups, tiny_model):
    up = ups(tmp_path / "state", "--model", tiny_model, "--engine", "transformers", "--redis-url", "embedded",
             "--cpu-workers", "1", "--no-flower", "--quiet", LLMPIPE_DTYPE="no-such-dtype")
    assert up.wait(120) == 1, up.err
    line = [ln for ln in up.err.splitlines() if ln.startswith("llmpipe up: ")]
    assert len(line) == 1 and "inference exited with code 3: engine transformers could not start" in line[0], up.err
    assert "no-such-dtype" in line[0] and "Traceback" not in up.err
    assert up.left_alive() == []


# -- supervision: a child killed with SIGKILL comes back, the stack stays up -------------


def _one(up: Up, *words: str) -> int:
    """The pid of the one live process whose command line holds every word."""
    end = time.monotonic() + 60
    while True:
        pids = [p for p in descendants(up.proc.pid) if alive(p) and all(w in _cmdline(p) for w in words)]
        if len(pids) == 1:
            return pids[0]
        assert time.monotonic() < end, f"{len(pids)} processes match {words}: {[_cmdline(p) for p in pids]}"
        time.sleep(0.2)


@pytest.mark.integration
def test_up_restarts_what_is_killed(tmp_path, ups, tiny_model):
    """`kill -9` of the inference worker (vLLM, its engine core in a process of its own as
    vLLM runs by default) and then of the API: each comes back by itself after 1 s, said on
    the console; no engine core is left behind; jobs succeed; Ctrl-C still stops it warm."""
    up = ups(tmp_path / "state", "--model", tiny_model, "--engine", "vllm", "--redis-url", "embedded",
             "--cpu-workers", "1", "--no-flower", VLLM_ENABLE_V1_MULTIPROCESSING="1", LLMPIPE_MAX_MODEL_LEN="512",
             LLMPIPE_MAX_BATCH_SIZE="4")
    up.wait_ready(timeout=300)
    body = {"prompt": "once upon a time", "max_tokens": 8, "temperature": 0}
    assert _result(up.url, _job(up.url, body))["status"] == "succeeded"

    inference = _one(up, "celery", "-Q inference")
    cores = [p for p in descendants(inference) if "EngineCore" in _cmdline(p)]
    assert cores, [_cmdline(p) for p in descendants(inference)]
    t_kill = time.monotonic()
    os.kill(inference, signal.SIGKILL)
    _wait_text(lambda: up.err, "llmpipe up: inference was killed by SIGKILL after", up)
    line = next(ln for ln in up.err.splitlines() if "inference was killed by SIGKILL" in ln)
    assert line.endswith("; restarting in 1 s (crash 1 of 5 in 300 s)"), line
    end = time.monotonic() + 10
    while any(alive(p) for p in cores):
        assert time.monotonic() < end, f"the killed worker's engine core {cores} outlived it"
        time.sleep(0.1)
    # A job sent while the worker restarts waits for it in the queue, and succeeds.
    job = _job(up.url, body)
    new_inference = _one(up, "celery", "-Q inference")
    assert new_inference != inference
    assert _result(up.url, job, timeout=240)["status"] == "succeeded"
    print(f"\ninference killed -> a job sent after it succeeded: {time.monotonic() - t_kill:.1f} s")

    api = _one(up, "llmpipe.cli", " api ")
    t_kill = time.monotonic()
    os.kill(api, signal.SIGKILL)
    _wait_text(lambda: up.err, "llmpipe up: api was killed by SIGKILL after", up)
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
    assert _one(up, "llmpipe.cli", " api ") != api
    assert _result(up.url, _job(up.url, body))["status"] == "succeeded"

    assert up.interrupt() == 0, up.err[-3000:]
    assert "warm shutdown" in up.err and up.err.rstrip().endswith("stopped")
    assert up.left_alive() == []
    assert "Traceback" not in up.err
