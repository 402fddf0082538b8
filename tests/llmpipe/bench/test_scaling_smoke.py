"""CI smoke run of ``llmpipe bench --modes scaling --quick``: real hosts (network
namespaces), the delaying proxies, 1, 2 and 4 inference workers, and the one-host layout.
No speed is asserted; what is checked is that the run measures what it claims to."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from llmpipe.local.supervisor import alive
from llmpipe.testing.hosts import netns

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))]


@pytest.mark.timeout(600)
def test_scaling_quick_runs_every_configuration_across_hosts(tmp_path, tiny_model):
    out = tmp_path / "scaling"
    proc = subprocess.run(
        [sys.executable, "-m", "llmpipe.cli", "bench", "--modes", "scaling", "--quick", "--model", tiny_model,
         "--out", str(out)], capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "results.json").read_text())
    rows = {(r["layout"], r["workers"], r["concurrency"]): r for r in result["rows"]}
    assert {("hosts-20ms", w, 8) for w in (1, 2, 4)} | {("hosts-20ms", 1, 1), ("one-host", 1, 1)} <= set(rows)
    for row in rows.values():
        assert "summary" in row, row.get("error")
        assert row["summary"]["errors"] == 0 and row["summary"]["ok"] > 0
    # Every running inference worker, each on its own host, served requests of the point.
    for w in (1, 2, 4):
        served = rows[("hosts-20ms", w, 8)]["per_worker"]
        assert set(served) == {f"inference-{i + 1}" for i in range(w)}
        assert all(v["requests"] > 0 and v["batches"] > 0 for v in served.values()), served
    # The hops are on the path: a request crosses client->API twice (POST, then GET) at
    # least, 20 ms each; the one-host layout runs no proxy at all.
    hops, one = rows[("hosts-20ms", 1, 1)], rows[("one-host", 1, 1)]
    assert min(hops["latencies_s"]) >= 0.040
    assert "proxies" in hops["cpu"]["cpu_s"] and "proxies" not in one["cpu"]["cpu_s"]
    net = result["analysis"]["network"]
    assert [n["concurrency"] for n in net] == [1] and net[0]["added_p50_s"] is not None
    assert [s["workers"] for s in result["analysis"]["scaling"]] == [1, 2, 4]
    md = (out / "report.md").read_text()
    assert "SIMULATED" in md and "speed-up" in md and "What the hops add" in md
    for png in ("scaling_hosts.png", "network_latency_cdf.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The run tore its hosts down: no namespace is left whose owner is gone.
    assert not [n for n in netns.list_netns() if (m := netns.PREFIX_RE.match(n)) and not alive(int(m.group(1)))]
