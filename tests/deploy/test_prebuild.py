"""tests/deploy/prebuild.py without Docker: what the run's controller decides from a
worker's collection, how a worker reads its outcomes, and that a build it stops leaves no
process behind."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import psutil
import pytest

from tests.deploy import docker_engine, prebuild
from tests.deploy.prebuild import COMPOSE_MODULE, ENGINE_FILE, ControllerPlugin, ImagesBuild, Prebuilt
from tests.harness.waiting import wait_until


class _Node:
    def __init__(self):
        self.workerinput: dict = {}


@pytest.fixture
def controller():
    c = ControllerPlugin()
    yield c
    c.pytest_unconfigure(None)
    assert not c.folder.exists()


def test_a_run_without_a_compose_test_builds_nothing_and_says_so(controller):
    node = _Node()
    controller.pytest_configure_node(node)
    controller.pytest_xdist_node_collection_finished(node, ["tests/api/test_jobs_api.py::test_a"])
    assert controller.prebuild is None
    outcome = Prebuilt(controller.folder).images()  # does not wait: the controller said so
    assert outcome["skipped"] and outcome["returncode"] is None
    assert node.workerinput[prebuild.FOLDER_KEY] == str(controller.folder)


def test_a_run_with_a_compose_test_starts_one_build(controller, monkeypatch):
    started = []

    class Recording:
        def __init__(self, folder):
            self.folder = folder

        def start(self):
            started.append(self.folder)
            return self

        def close(self):
            started.append("closed")

    monkeypatch.setattr(prebuild, "Prebuild", Recording)
    ids = [f"{COMPOSE_MODULE}::test_every_service_is_up[redis]", "tests/api/test_jobs_api.py::test_a"]
    controller.pytest_xdist_node_collection_finished(_Node(), ids)
    controller.pytest_xdist_node_collection_finished(_Node(), ids)  # the second worker's
    assert started == [controller.folder]
    controller.pytest_unconfigure(None)
    assert started == [controller.folder, "closed"]


def test_a_worker_fails_with_the_controllers_engine_error_without_waiting(tmp_path):
    (tmp_path / ENGINE_FILE).write_text(json.dumps({"error": "dockerd did not answer within 60 s"}))
    pre = Prebuilt(tmp_path)
    with pytest.raises(docker_engine.EngineUnavailable, match="did not answer"):
        pre.engine()
    assert pre.images()["stderr"] == "dockerd did not answer within 60 s"


def test_a_worker_without_a_controller_builds_itself(tmp_path):
    class Config:
        pass

    assert prebuild.prebuilt(Config()) is None  # one process: no workerinput
    Config.workerinput = {prebuild.FOLDER_KEY: str(tmp_path)}
    assert prebuild.prebuilt(Config()).folder == tmp_path


def _build(tmp_path, body: str) -> ImagesBuild:
    """An ImagesBuild of a shell script with ``body`` in place of scripts/compose-images.sh."""
    script = tmp_path / "build.sh"
    script.write_text(f"#!/bin/sh\n{body}")
    script.chmod(0o755)
    return ImagesBuild(["compose"], script=script)


def test_a_stopped_build_leaves_no_process_behind(tmp_path):
    pids = tmp_path / "pids"
    build = _build(tmp_path, f"sleep 300 &\necho $$ $! > {pids}.tmp && mv {pids}.tmp {pids}\nwait\n")
    outcome: dict = {}
    t = threading.Thread(target=lambda: outcome.update(build.run()))
    t.start()
    wait_until(pids.exists, 30, "the build script to start its child")
    shell, child = map(int, pids.read_text().split())
    build.stop()
    t.join(timeout=30)
    assert not t.is_alive() and outcome["returncode"] != 0
    for pid in (shell, child):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid


def test_a_build_stopped_before_it_starts_never_starts(tmp_path):
    ran = tmp_path / "ran"
    build = _build(tmp_path, f"touch {ran}\n")
    build.stop()
    assert build.run()["stderr"] == "stopped before it started"
    assert build.proc is None and not ran.exists()


def test_the_wait_for_a_build_is_bounded_and_says_whether_it_ended(tmp_path):
    config = SimpleNamespace(workerinput={prebuild.FOLDER_KEY: str(tmp_path)})
    assert prebuild.wait_for_image_build(config, timeout=0.2) is False  # a build still going on
    (tmp_path / prebuild.IMAGES_FILE).write_text(json.dumps({"returncode": 0, "stdout": "", "stderr": "",
                                                             "seconds": 1.0}))
    assert prebuild.wait_for_image_build(config, timeout=0.2) is True
