"""The shipped Grafana dashboard only queries metrics that llmpipe defines."""

import json
import re
from pathlib import Path

DASH = Path(__file__).resolve().parent.parent / "docs" / "grafana" / "llmpipe.json"


def test_dashboard_queries_only_defined_metrics():
    from prometheus_client import REGISTRY

    import llmpipe.observability.metrics  # noqa: F401  (registers the metrics)

    defined = {"llmpipe_queue_depth_messages"}
    for metric in REGISTRY.collect():
        for s in metric.samples:
            defined.add(s.name)
        defined.add(metric.name)
    dash = json.loads(DASH.read_text())
    used = set()
    for p in dash["panels"]:
        for t in p["targets"]:
            used |= set(re.findall(r"llmpipe_[a-z0-9_]+", t["expr"]))
    assert used, "dashboard has no queries"
    missing = {u for u in used if u not in defined and u.rsplit("_", 1)[0] not in defined}
    assert not missing, missing
