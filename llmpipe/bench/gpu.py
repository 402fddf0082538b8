"""GPU utilization and memory, sampled every 0.5 s by ``nvidia-smi`` during a run.

``nvidia-smi -lms 500`` runs as one child that prints a CSV line per interval; a thread
stamps each line with the wall clock (the load generator's clock), so that a load point's
samples are those inside its window. Without nvidia-smi (the CPU rehearsal) the sampler
says so and records nothing: no GPU figure is ever made up.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field

QUERY = "utilization.gpu,memory.used,memory.total"


@dataclass
class GpuSample:
    t: float  # epoch seconds
    util_pct: float
    mem_used_mib: float
    mem_total_mib: float


def parse_line(line: str, t: float) -> GpuSample | None:
    """One CSV line of ``--format=csv,noheader,nounits`` (first GPU only); None if not one."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 3:
        return None
    try:
        util, used, total = (float(p) for p in parts)
    except ValueError:  # "[N/A]" or a header
        return None
    return GpuSample(t, util, used, total)


@dataclass
class GpuSampler:
    interval_ms: int = 500
    samples: list[GpuSample] = field(default_factory=list)
    unavailable: str | None = None
    _proc: subprocess.Popen | None = None
    _thread: threading.Thread | None = None
    name: str = ""

    def start(self) -> GpuSampler:
        exe = shutil.which("nvidia-smi")
        if exe is None:
            self.unavailable = "no nvidia-smi on this machine"
            return self
        try:
            self.name = subprocess.run([exe, "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
            self._proc = subprocess.Popen([exe, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                                           f"--loop-ms={self.interval_ms}", "--id=0"],
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)
        except (OSError, subprocess.SubprocessError, IndexError) as e:
            self.unavailable = f"nvidia-smi failed: {e}"
            return self
        self._thread = threading.Thread(target=self._read, name="gpu-sampler", daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            s = parse_line(line, time.time())
            if s is not None:
                self.samples.append(s)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        if self._thread is not None:
            self._thread.join(5)

    def summary(self, lo: float, hi: float) -> dict:
        """Utilization and memory over the samples taken in [lo, hi] (epoch seconds)."""
        if self.unavailable:
            return {"unavailable": self.unavailable}
        got = [s for s in list(self.samples) if lo <= s.t <= hi]
        if not got:
            return {"samples": 0}
        util = sorted(s.util_pct for s in got)
        return {"samples": len(got), "util_mean_pct": sum(util) / len(util), "util_p50_pct": util[len(util) // 2],
                "util_min_pct": util[0], "mem_used_max_mib": max(s.mem_used_mib for s in got),
                "mem_total_mib": got[-1].mem_total_mib}

    def timeline(self) -> list[list[float]]:
        return [[round(s.t, 2), s.util_pct, s.mem_used_mib] for s in list(self.samples)]
