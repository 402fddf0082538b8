"""Linux network namespaces through iproute2: the hosts of the harness and their wiring.

Everything here runs ``ip`` as root. A host is a namespace with one veth interface
(``eth0``) whose peer sits on a bridge in a "switch" namespace, so nothing is added to
the root namespace: no interface, no address, no route. A host's routing table holds only
its own subnet, so any other address (the machine's, the internet, 127.0.0.1 of the root
namespace) is unreachable from it by construction.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import re
import signal
import subprocess
import time
from pathlib import Path

NETNS_DIR = Path("/run/netns")
_CLONE_NEWNET = 0x40000000
# lph-<owner pid>-<4 hex>-<role>: the owner's pid tells a stale run's namespaces (their
# owner died) from those of a run still going on in parallel.
PREFIX_RE = re.compile(r"^lph-(\d+)-[0-9a-f]{4}-")


class NetnsError(RuntimeError):
    """An ``ip`` command failed, or the machine cannot host namespaces."""


def ip(*args: str, check: bool = True) -> str:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def available() -> str | None:
    """None when namespaces can be made here, else why not (for a test's skip reason)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    try:
        ip("netns", "list")
    except (OSError, NetnsError) as e:
        return f"iproute2 is missing or refuses: {e}"
    return None


def list_netns() -> list[str]:
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def add_netns(name: str) -> None:
    ip("netns", "add", name)
    ip("-n", name, "link", "set", "lo", "up")


def ns_pids(name: str) -> list[int]:
    out = ip("netns", "pids", name, check=False)
    return [int(p) for p in out.split() if p.isdigit()]


def kill_ns_processes(name: str, timeout: float = 10.0) -> list[int]:
    """SIGKILL every process inside the namespace until none is left; returns the pids
    that were killed."""
    killed: list[int] = []
    end = time.monotonic() + timeout
    while pids := ns_pids(name):
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        if time.monotonic() > end:
            raise NetnsError(f"processes {pids} in namespace {name} survive SIGKILL")
        time.sleep(0.05)
    return killed


def delete_netns(name: str) -> None:
    """Kill what runs inside, then remove it (its veths and their peers go with it)."""
    if not (NETNS_DIR / name).exists():
        return
    kill_ns_processes(name)
    ip("netns", "del", name, check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale() -> list[str]:
    """Remove the namespaces of harness runs whose owner process is gone (a run killed
    with SIGKILL cannot clean up after itself)."""
    removed = []
    for name in list_netns():
        m = PREFIX_RE.match(name)
        if m and not _alive(int(m.group(1))):
            delete_netns(name)
            removed.append(name)
    return removed


def root_networks() -> list[ipaddress.IPv4Network]:
    """The IPv4 networks configured on the root namespace's interfaces."""
    nets = []
    for line in ip("-4", "-o", "addr", "show").splitlines():
        parts = line.split()
        if "inet" in parts:
            nets.append(ipaddress.ip_interface(parts[parts.index("inet") + 1]).network)
    return nets


def add_bridge(ns: str, bridge: str = "br0") -> None:
    ip("-n", ns, "link", "add", bridge, "type", "bridge")
    ip("-n", ns, "link", "set", bridge, "up")


def plug(switch_ns: str, port: str, host_ns: str, address: str, prefixlen: int, bridge: str = "br0") -> None:
    """A veth pair: ``port`` on the switch's bridge, ``eth0`` with ``address`` in the host.
    No IPv6 link-local address is generated, so the host speaks only our IPv4."""
    ip("-n", switch_ns, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", host_ns)
    ip("-n", switch_ns, "link", "set", port, "master", bridge)
    ip("-n", switch_ns, "link", "set", port, "up")
    ip("-n", host_ns, "link", "set", "eth0", "addrgenmode", "none")
    ip("-n", host_ns, "addr", "add", f"{address}/{prefixlen}", "dev", "eth0")
    ip("-n", host_ns, "link", "set", "eth0", "up")


def set_port(switch_ns: str, port: str, up: bool) -> None:
    ip("-n", switch_ns, "link", "set", port, "up" if up else "down")


_LIBC: list = []


def enter_netns(name: str) -> None:
    """Move the *calling thread* into namespace ``name``. Sockets it (or threads it
    starts) creates afterwards live in that namespace; other threads are not affected."""
    if not _LIBC:
        _LIBC.append(ctypes.CDLL(None, use_errno=True))
    fd = os.open(NETNS_DIR / name, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _LIBC[0].setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({name}): {os.strerror(err)}")
    finally:
        os.close(fd)


def exec_argv(name: str, argv: list[str]) -> list[str]:
    """``argv`` run inside namespace ``name``. ``ip netns exec`` execs in place, so the pid
    Popen returns is the program's own and PR_SET_PDEATHSIG set before it still holds."""
    return ["ip", "netns", "exec", name, *argv]


__all__ = ["NetnsError", "add_bridge", "add_netns", "available", "clean_stale", "delete_netns", "enter_netns",
           "exec_argv", "ip", "kill_ns_processes", "list_netns", "ns_pids", "plug", "root_networks", "set_port"]
