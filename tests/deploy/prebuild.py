"""The Compose run's Docker engine and images, made in the background from the start of a
run in several processes (pytest-xdist's controller), while the test processes run other
tests; tests/deploy/test_compose_up.py's fixtures wait for them.

A cold build (debootstrap, apt and pip downloads, then the image layers: about 4.5 min
here, much of it waiting on downloads) held one of the two test processes from the run's
start when the Compose fixture made it. The controller now starts it as soon as a
worker's collection shows a Compose test, and passes its outcome to the workers through
two files in a folder of its own. The build shares the cores with the tests: dockerd's
nice (tests/deploy/docker_engine.py) does not reach across the kernel's autogroups, one
per session, so the tests beside it run slower; the overlap wins on its downloads. In one
process (``-n0``, ``-p no:xdist``) the fixtures make both themselves, as then nothing else
would run meanwhile.

What the controller starts it stops: the build at the end of the run (or a Ctrl-C), and a
dockerd it started."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import psutil

from tests.deploy import docker_engine
from tests.deploy.compose_stack import IMAGES_SCRIPT, compose_cli
from tests.harness.waiting import poll, wait_until

COMPOSE_MODULE = "tests/deploy/test_compose_up.py"
FOLDER_KEY = "llmpipe_compose_prebuild"  # the workers' workerinput: the folder of the two files
ENGINE_FILE, IMAGES_FILE = "engine.json", "images.json"
BUILD_TIMEOUT_S = 1500.0
ENGINE_TIMEOUT_S = docker_engine.INSTALL_TIMEOUT_S + docker_engine.START_TIMEOUT_S + 60.0


def _write(path: Path, value: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)  # whole or absent when a worker reads it


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


class ImagesBuild:
    """scripts/compose-images.sh run once, with the Compose CLI ``cli``: its outcome as a dict
    (``returncode``, ``stdout``, ``stderr``, ``seconds``); ``stop`` ends it early."""

    def __init__(self, cli: list[str], script: Path = IMAGES_SCRIPT):
        self.cli = cli
        self.script = script
        self.proc: subprocess.Popen | None = None
        # The script runs (and starts its children) before Popen returns to run(): a stop()
        # in that window found no process to stop, and the build went on (seen under load).
        self._lock = threading.Lock()
        self._stopped = False

    def run(self) -> dict:
        env = {**os.environ, "LLMPIPE_COMPOSE": " ".join(self.cli)}
        t0 = time.monotonic()
        with self._lock:
            if self._stopped:
                return {"returncode": None, "stdout": "", "stderr": "stopped before it started", "seconds": 0.0}
            self.proc = subprocess.Popen([str(self.script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            out, err = self.proc.communicate(timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.stop()
            out, err = self.proc.communicate()
            err += f"\n{self.script.name} did not finish within {BUILD_TIMEOUT_S:.0f} s"
        return {"returncode": self.proc.returncode, "stdout": out, "stderr": err, "seconds": time.monotonic() - t0}

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the script and the docker builds it runs
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
            # The script's children got the signal with it, but under load one was still running
            # when the script had exited: wait for the group, and kill what is left of it.
            if not poll(lambda: not _live_members(self.proc.pid), 10, every=0.05):
                os.killpg(self.proc.pid, signal.SIGKILL)


def _live_members(pgid: int) -> list[int]:
    """The processes of group ``pgid`` that still run (a zombie has ended)."""
    live = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                live.append(p.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return live


class Prebuild:
    """The controller's side: the engine, then the images, in a thread; each outcome to its
    file in ``folder`` as soon as it is known."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.engine: docker_engine.Engine | None = None
        self.build: ImagesBuild | None = None
        self.closing = threading.Event()
        self.thread = threading.Thread(target=self._run, name="compose-prebuild", daemon=True)

    def start(self) -> Prebuild:
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            self.engine = docker_engine.ensure(self.folder)
        except Exception as exc:  # noqa: BLE001 - the workers' fixtures fail (or skip) with it, rather than wait
            unavailable = isinstance(exc, docker_engine.EngineUnavailable)
            _write(self.folder / ENGINE_FILE, {"error": str(exc) if unavailable else f"{type(exc).__name__}: {exc}"})
            return
        _write(self.folder / ENGINE_FILE, {"error": None})
        cli = compose_cli()
        if cli is None:  # the `cli` fixture fails with its own message
            _write(self.folder / IMAGES_FILE, {"returncode": None, "stdout": "", "stderr": "no Compose v2 CLI",
                                               "seconds": 0.0})
            return
        if self.closing.is_set():  # the run ended while the engine started
            return
        self.build = ImagesBuild(cli)
        try:
            outcome = self.build.run()
        except Exception as exc:  # noqa: BLE001 - its fixture fails with it, rather than wait
            outcome = {"returncode": None, "stdout": "", "stderr": f"{type(exc).__name__}: {exc}", "seconds": 0.0}
        _write(self.folder / IMAGES_FILE, outcome)

    def close(self) -> None:
        self.closing.set()
        if self.build is not None:
            self.build.stop()
        self.thread.join(timeout=120)
        if self.engine is not None:
            self.engine.stop()


class Prebuilt:
    """A worker's side: waits for the controller's outcomes."""

    def __init__(self, folder: Path):
        self.folder = folder

    def engine(self) -> docker_engine.Engine:
        """The engine the controller made ready (it stops it), or its EngineUnavailable."""
        got = wait_until(lambda: _read(self.folder / ENGINE_FILE), ENGINE_TIMEOUT_S,
                         "the run's controller to start a Docker engine", every=0.5)
        if got["error"]:
            raise docker_engine.EngineUnavailable(got["error"])
        return docker_engine.Engine()

    def images(self) -> dict:
        """The build's outcome (``skipped`` where the run has no Compose test). Called after
        ``engine``: the build had begun, and the controller ends it by BUILD_TIMEOUT_S, within
        the Compose tests' own timeout."""
        return wait_until(self.outcome, BUILD_TIMEOUT_S + 60.0,
                          "the run's controller to build the Compose images", every=0.5)

    def outcome(self) -> dict | None:
        """The build's outcome, or None while it goes on."""
        got = _read(self.folder / IMAGES_FILE)
        if got is None and (engine := _read(self.folder / ENGINE_FILE)) and engine["error"]:
            got = {"returncode": None, "stdout": "", "stderr": engine["error"], "seconds": 0.0}
        return got


def wait_for_image_build(config, timeout: float = 240.0) -> bool:
    """Whether no image build of this run goes on, within ``timeout`` s at most (then the
    caller goes on beside it). For a test that a build beside it would starve: a compiled
    inference worker's restart did not serve within 300 s of its kill beside the build in
    CI, against 34 s alone."""
    pre = prebuilt(config)
    return pre is None or bool(poll(pre.outcome, timeout, every=0.5))


def prebuilt(config) -> Prebuilt | None:
    """In an xdist worker of a run whose controller builds: its outcomes; else None."""
    folder = getattr(config, "workerinput", {}).get(FOLDER_KEY)
    return Prebuilt(Path(folder)) if folder else None


class ControllerPlugin:
    """Registered in the xdist controller (tests/harness/plugin.py): starts the build once a
    worker's collection holds a Compose test, and ends what it started with the run."""

    def __init__(self):
        self.folder = Path(tempfile.mkdtemp(prefix="llmpipe-compose-prebuild-"))
        self.prebuild: Prebuild | None = None
        self.decided = False

    def pytest_configure_node(self, node) -> None:
        node.workerinput[FOLDER_KEY] = str(self.folder)

    def pytest_xdist_node_collection_finished(self, node, ids) -> None:
        if self.decided:  # every worker collects the same tests
            return
        self.decided = True
        if any(i.startswith(COMPOSE_MODULE + "::") for i in ids):
            self.prebuild = Prebuild(self.folder).start()
        else:
            _write(self.folder / IMAGES_FILE, {"returncode": None, "skipped": "no Compose test in this run",
                                               "stdout": "", "stderr": "", "seconds": 0.0})

    def pytest_unconfigure(self, config) -> None:
        if self.prebuild is not None:
            self.prebuild.close()
        shutil.rmtree(self.folder, ignore_errors=True)
