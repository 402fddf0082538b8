"""Celery's "superuser privileges" warning: silenced where root is on purpose, shown elsewhere."""

import os
import subprocess
import sys

import pytest

from llmpipe.celery_app import root_is_expected

# What a worker does at start (celery/apps/worker.py), after the app (`-A tasks`) loaded.
CHECK = "import llmpipe.celery_app; from celery.platforms import check_privileges; check_privileges(['json'])"


def _stderr(allow: str) -> str:
    env = {**os.environ, "LLMPIPE_ALLOW_ROOT": allow, "PYTHONWARNINGS": ""}
    return subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=60).stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="the warning is for root only")
def test_the_switch_silences_the_warning_and_off_keeps_it():
    assert "superuser privileges" not in _stderr("true")
    assert "superuser privileges" in _stderr("false")


def test_root_is_expected_in_a_container_unless_said_otherwise():
    assert root_is_expected(True) and not root_is_expected(False)
    in_container = os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv")
    assert root_is_expected(None) == in_container
