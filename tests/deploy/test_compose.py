"""Static checks of docker-compose.yml, with no Docker engine: it is validated against the
Compose specification's JSON schema, vendored as tests/data/compose-spec.json (the schema
that Docker Compose v2.40.3 embeds and validates with; Apache-2.0, compose-spec project),
with jsonschema, and explicit assertions pin down the deployment's promises (Redis
internal and durable, health-gated start order, GPU reservation, non-root, scalable CPU
stages, required Flower password, warm shutdown). The Dockerfiles: test_dockerfiles.py;
the real Compose CLI, when at hand: test_compose_cli.py.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.deploy.compose_spec import (
    CPU_INFERENCE_WORKER,
    CPU_INFERENCE_WORKERS,
    CPU_STAGE_WORKERS,
    GPU_WORKER,
    GPU_WORKERS,
    MODELS,
    QUEUES,
    ROOT,
    SCHEMA_FILE,
    command_of,
    default_of,
    depends_on,
    duration_s,
    llmpipe_services,
    uid,
    variable_of,
    volume_mounts,
    workers_of,
)

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
    queues = {command_of(s)[1] for s in workers_of(services).values()}
    assert set(QUEUES) <= queues


def test_no_container_names_anywhere(services):
    # container_name would make `--scale` fail (names must be unique).
    assert [n for n, s in services.items() if "container_name" in s] == []


# ------------------------------------------------------------------------------ redis


def test_redis_is_internal_durable_and_healthchecked(compose, services):
    redis = services["redis"]
    assert default_of(redis["image"]).split(":")[0] == "redis"
    assert default_of(redis["image"]).split(":")[1].startswith("7")
    assert "ports" not in redis, "Redis has no auth: it must not be published"
    assert "network_mode" not in redis

    cmd = " ".join(command_of(redis))
    assert re.search(r"--appendonly\s+yes\b", cmd), cmd
    assert re.search(r"--appendfsync\s+everysec\b", cmd), cmd
    assert re.search(r"--dir\s+/data\b", cmd), cmd  # the AOF lives on the volume, whatever the image's workdir

    mounts = volume_mounts(redis)
    assert mounts.get("redis-data") == "/data"
    assert "redis-data" in compose["volumes"]

    test = redis["healthcheck"]["test"]
    test = " ".join(test) if isinstance(test, list) else test
    assert "redis-cli ping" in test
    assert redis.get("restart") in {"always", "unless-stopped"}


# ---------------------------------------------------------------- start order, health


def test_every_worker_waits_for_healthy_redis_and_the_model(services):
    workers = workers_of(services)
    assert set(CPU_STAGE_WORKERS) | {GPU_WORKER, CPU_INFERENCE_WORKER, "worker-collect"} <= set(workers)
    for name, svc in workers.items():
        dep = depends_on(svc)
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
    assert _option(command_of(services["api"]), "--host") == "0.0.0.0"
    assert _option(command_of(services["flower"]), "--address") == "0.0.0.0"
    assert _option(command_of(services["api"]), "--port") == "8000"
    assert _option(command_of(services["flower"]), "--port") == "5555"
    assert any(str(p).endswith(":8000") for p in services["api"]["ports"])
    assert any(str(p).endswith(":5555") for p in services["flower"]["ports"])


def test_api_is_published_healthchecked_and_health_gated(services):
    api = services["api"]
    assert command_of(api)[:1] == ["api"]
    assert api.get("ports"), "the API must be published"
    test = api["healthcheck"]["test"]
    test = " ".join(test) if isinstance(test, list) else test
    assert "/healthz" in test
    assert depends_on(api)["redis"]["condition"] == "service_healthy"


def test_model_init_is_a_one_shot_that_fills_the_shared_volume(compose, services):
    init = services["model-init"]
    assert command_of(init) == ["model", *MODELS]  # every served model, prepared once
    assert str(init.get("restart", "no")) == "no"
    target = volume_mounts(init).get("models")
    assert target, "model-init must mount the shared `models` volume"
    assert "models" in compose["volumes"]
    state_dir = init["environment"]["LLMPIPE_STATE_DIR"]
    assert target == f"{state_dir.rstrip('/')}/models"
    for name, svc in workers_of(services).items():
        assert volume_mounts(svc).get("models") == target, name
        assert svc["environment"]["LLMPIPE_STATE_DIR"] == state_dir, name


def test_all_llmpipe_processes_use_the_compose_redis(services):
    for name, svc in llmpipe_services(services).items():
        assert svc["environment"]["LLMPIPE_REDIS_URL"] == "redis://redis:6379/0", name


# --------------------------------------------------------------------- the two profiles


def test_gpu_inference_worker_reserves_a_gpu(services):
    svc = services[GPU_WORKER]
    assert command_of(svc)[:2] == ["worker", "inference"]
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
    assert command_of(svc)[:2] == ["worker", "inference"]
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
    assert default_of(mq["image"]).split(":")[0] == "rabbitmq"
    assert "ports" not in mq, "the broker stays on the compose network"
    assert volume_mounts(mq).get("rabbitmq-data") == "/var/lib/rabbitmq" and "rabbitmq-data" in compose["volumes"]
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
    for name, svc in llmpipe_services(services).items():
        assert svc["environment"].get("LLMPIPE_BROKER_URL") == "${LLMPIPE_BROKER_URL:-}", name  # empty: Redis
    for name in (*workers_of(services), "api", "flower"):
        dep = depends_on(services[name]).get("rabbitmq", {})
        assert dep.get("condition") == "service_healthy" and dep.get("required") is False, name


def test_rabbitmq_use_is_documented_at_the_top(compose_text):
    head = compose_text.split("\nservices:", 1)[0]
    assert "--profile rabbitmq" in head and "LLMPIPE_BROKER_URL=amqp://" in head


# ------------------------------------------------------------------ security, scaling


def test_llmpipe_services_run_as_non_root(services):
    for name, svc in llmpipe_services(services).items():
        user = svc.get("user")
        assert user, f"{name} has no `user:`"
        assert uid(user) not in {"0", "root", ""}, f"{name} runs as {user!r}"


def test_flower_needs_a_password_from_the_environment(services):
    flower = services["flower"]
    assert command_of(flower)[:1] == ["flower"]
    env = flower["environment"]
    assert re.fullmatch(r"\$\{FLOWER_PASSWORD:\?[^}]+\}", env["LLMPIPE_FLOWER_PASSWORD"])
    assert env.get("LLMPIPE_FLOWER_USER")
    assert depends_on(flower)["redis"]["condition"] == "service_healthy"


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
    for name, svc in workers_of(services).items():
        assert svc.get("stop_signal") == "SIGTERM", name
        grace = duration_s(svc.get("stop_grace_period", "10s"))
        assert grace >= 30, f"{name}: stop_grace_period {grace}s is too short for a warm shutdown"
        if name not in (GPU_WORKER, CPU_INFERENCE_WORKER):
            cpu_grace.append(grace)
    for name in (GPU_WORKER, CPU_INFERENCE_WORKER):
        assert duration_s(services[name]["stop_grace_period"]) >= max(cpu_grace), name


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



# Every image the file names is a variable whose default is the public one, so that a
# machine with no registry can run local stand-ins (scripts/compose-images.sh).
PUBLIC_IMAGES = {"redis": ("REDIS_IMAGE", "redis:7"), "rabbitmq": ("RABBITMQ_IMAGE", "rabbitmq:4.1-management"),
                 "api": ("LLMPIPE_CPU_IMAGE", "llmpipe:cpu"), GPU_WORKER: ("LLMPIPE_GPU_IMAGE", "llmpipe:gpu")}
# The bases the Dockerfiles build on: build arguments the file passes from the environment.
BASE_ARGS = {"docker/Dockerfile": ["PYTHON_IMAGE", "TORCH_INDEX_URL"], "docker/Dockerfile.gpu": ["VLLM_IMAGE", "VLLM_EXTRA"]}


def test_every_image_is_a_variable_with_the_public_default(services):
    for name, (var, public) in PUBLIC_IMAGES.items():
        image = services[name]["image"]
        assert (variable_of(image), default_of(image)) == (var, public), name
    for name, svc in services.items():
        assert variable_of(svc.get("image", "${X}")), f"{name}: image {svc.get('image')!r} is not a variable"
        if "build" in svc:
            # no value: the environment's when set, else the Dockerfile's own default
            assert svc["build"].get("args") == BASE_ARGS[svc["build"]["dockerfile"]], name


def test_inference_workers_keep_the_compile_cache_on_a_volume(compose, services):
    text = (ROOT / "docker" / "Dockerfile").read_text() + (ROOT / "docker" / "Dockerfile.gpu").read_text()
    roots = set(re.findall(r"(?:VLLM_CACHE_ROOT|TORCHINDUCTOR_CACHE_DIR)=(\S+)", text))
    assert len(roots) == 2, roots  # one pair of paths, the same in both images
    assert "vllm-cache" in compose["volumes"]
    for name in (*GPU_WORKERS.values(), *CPU_INFERENCE_WORKERS.values()):
        target = volume_mounts(services[name]).get("vllm-cache")
        assert target and all(r.startswith(target.rstrip("/") + "/") for r in roots), (name, target)


def test_two_models_each_with_its_own_inference_worker_per_profile(services):
    from llmpipe.settings import Settings

    env = services["api"]["environment"]
    served = Settings(models=env["LLMPIPE_MODELS"].split(":-", 1)[-1].rstrip("}")).served
    assert tuple(served.names) == MODELS and served.several
    for profile, by_model in (("gpu", GPU_WORKERS), ("cpu", CPU_INFERENCE_WORKERS)):
        for model, name in by_model.items():
            svc = services[name]
            assert command_of(svc) == ["worker", "inference", "--model", model], name
            assert svc.get("profiles") == [profile], name
            assert depends_on(svc)["model-init"]["condition"] == "service_completed_successfully", name
    # On one GPU the two engines share its memory: their shares fit in it.
    shares = [float(re.search(r":-([0-9.]+)\}", services[n]["environment"]["LLMPIPE_GPU_MEMORY_UTILIZATION"]).group(1))
              for n in GPU_WORKERS.values()]
    assert sum(shares) <= 0.9
    assert services[GPU_WORKERS["tiny"]]["deploy"] == services[GPU_WORKER]["deploy"]
    assert services[CPU_INFERENCE_WORKERS["tiny"]]["cap_add"] == services[CPU_INFERENCE_WORKER]["cap_add"]
