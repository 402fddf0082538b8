"""What the deployment tests read: the files' paths, the services' names, and helpers over
docker-compose.yml as YAML."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
SCHEMA_FILE = ROOT / "tests" / "data" / "compose-spec.json"
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


def command_of(svc: dict) -> list[str]:
    cmd = svc.get("command") or []
    return cmd.split() if isinstance(cmd, str) else [str(c) for c in cmd]


def workers_of(services: dict) -> dict:
    """Services that run `llmpipe worker <queue>`."""
    return {n: s for n, s in services.items() if command_of(s)[:1] == ["worker"]}


def llmpipe_services(services: dict) -> dict:
    """Every service that runs an llmpipe image (all but redis and rabbitmq)."""
    return {n: s for n, s in services.items() if n not in ("redis", "rabbitmq")}


def depends_on(svc: dict) -> dict:
    dep = svc.get("depends_on") or {}
    if isinstance(dep, list):  # short syntax: no condition at all
        return {name: {"condition": "service_started"} for name in dep}
    return dep


def volume_mounts(svc: dict) -> dict[str, str]:
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


def duration_s(value) -> float:
    """Compose duration ('90s', '1m30s', '1h', '1m0s', or seconds as a number)."""
    if isinstance(value, (int, float)):
        return float(value)
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", str(value))
    assert parts and "".join(a + b for a, b in parts) == str(value), f"bad duration {value!r}"
    return sum(float(n) * units[u] for n, u in parts)


def default_of(value: str) -> str:
    """The value Compose takes for ``${VAR:-default}`` when VAR is unset (``value`` as is
    when it names no variable)."""
    m = re.fullmatch(r"\$\{(\w+):?-([^}]*)\}", str(value))
    return m.group(2) if m else str(value)


def variable_of(value: str) -> str | None:
    m = re.fullmatch(r"\$\{(\w+)(?::?[-?][^}]*)?\}", str(value))
    return m.group(1) if m else None


def uid(user: str) -> str:
    return str(user).split(":", 1)[0].strip()
