"""One or more points of the scaling bench on the hosts layout, with a timeline: how the
4-worker, c=128 miss of docs/benchmarks.md ("Why 4 workers at c=128 missed") was diagnosed.

    python benchmarks/scaling_point_timeline.py '[[4, 128]]' OUT ['{"sim_step_ms": 18.4, ...}']

Runs ``llmpipe bench --modes scaling``'s own code (llmpipe/bench/scaling.py) for the given
(workers, concurrency) points only, with its report in OUT, plus ``OUT/diag.json``:
* ``timeline``: each second, the whole machine's CPU busy share (/proc/stat), the load
  average, the stage queue depths (read directly from Redis, from the client host) and each
  inference worker's batch totals;
* ``samples``: per request, the client's POST time, total latency and the job's stage
  timings.
The third argument takes bench options as ``bench_scaling`` names them (e.g. the simulated
costs); without it, the bench's defaults.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import psutil
from rich.console import Console

import llmpipe.bench.scaling as sc
from llmpipe.bench import loadgen

points = json.loads(sys.argv[1])
out = sys.argv[2]
given = {"out": out, **(json.loads(sys.argv[3]) if len(sys.argv) > 3 else {})}
timeline: list[dict] = []
samples: list[list[dict]] = []


class _TimedPost:
    """The load generator's HTTP client, with the POST's duration kept on the sample."""

    def __init__(self, http, s):
        self._http, self._s = http, s

    async def post(self, *a, **k):
        t0 = time.time()
        r = await self._http.post(*a, **k)
        self._s.extra["post_s"] = time.time() - t0
        return r

    def __getattr__(self, name):
        return getattr(self._http, name)


_request = loadgen.JobsClient.request


async def request(self, http, s, prompt):
    await _request(self, _TimedPost(http, s), s, prompt)


loadgen.JobsClient.request = request
_measure = sc.measure


def measure(hp, o, layout, workers, c, network, console):
    import redis

    from llmpipe.broker.queue_depth import RedisDepths
    from llmpipe.testing.hosts import netns

    stop = threading.Event()

    def sample() -> None:
        netns.enter_netns(hp.hosts.hosts[hp.placement.client].ns)  # this thread only
        depths = RedisDepths(redis.Redis.from_url(hp.control_redis_url))
        last = psutil.cpu_times()
        while not stop.wait(1.0):
            now = psutil.cpu_times()
            total = sum(now) - sum(last)
            idle = (now.idle + now.iowait) - (last.idle + last.iowait)
            last = now
            try:
                d = depths.sample(["preprocess", "inference", "postprocess"], fresh=True).depths
            except Exception as e:  # noqa: BLE001 - a missed sample is recorded, not fatal
                d = {"error": str(e)}
            timeline.append({"t": time.time(), "workers": workers, "c": c, "busy": 1 - idle / total if total else None,
                             "load1": psutil.getloadavg()[0], "depths": d, "batch_totals": hp.batch_totals()})

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        return _measure(hp, o, layout, workers, c, network, console)
    finally:
        stop.set()
        th.join()


_run_load = loadgen.run_load


async def run_load(*a, **k):
    got = await _run_load(*a, **k)
    samples.append([{"i": x.i, "start": x.start, "latency_s": x.latency_s, "post_s": x.extra.get("post_s"),
                     "ok": x.ok, "timings": x.extra.get("timings"), "batch_size": x.batch_size} for x in got])
    return got


sc.measure, sc.run_load = measure, run_load
sc.run_scaling = lambda o, console: sc._run_layout(o, f"hosts-{o.hop_rtt_ms:g}ms", console,
                                                   [(w, c, False) for w, c in points])
rc = sc.bench_scaling(given, Console(stderr=True, highlight=False))
with open(f"{out}/diag.json", "w") as f:
    json.dump({"timeline": timeline, "samples": samples}, f)
sys.exit(rc)
