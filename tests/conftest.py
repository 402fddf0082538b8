"""Every test's fixtures and hooks are in tests/harness/plugin.py; the helpers (stacks,
clients, waiting, brokers) in tests/harness/ (its __init__ maps them)."""

import pytest

pytest.register_assert_rewrite("tests.harness")

pytest_plugins = ["tests.harness.plugin"]
