"""Every test's fixtures and hooks are in tests/harness/plugin.py; the helpers (stacks,
clients, waiting, brokers) in tests/harness/ (its __init__ maps them)."""

import pytest

pytest.register_assert_rewrite("tests.harness")

from tests.harness.engine import apply_test_env  # noqa: E402 (after the rewrite is registered)

apply_test_env()  # before anything imports vLLM, transformers or huggingface_hub

pytest_plugins = ["tests.harness.plugin"]
