"""docs/grafana/sinkgate.json: a dashboard Grafana can import, whose every query
names only metrics a live gateway's /metrics exposes (a renamed metric would
leave a panel silently empty)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import destination, make_config
from tests.served import served

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "sinkgate.json"
_METRIC = re.compile(r"\bsinkgate_[a-z_]+")
# The series names a metric family of each type exposes.
_SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count", ""),
}


def queries(dashboard: dict[str, Any]) -> list[str]:
    found = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    found += [a["expr"] for a in dashboard.get("annotations", {}).get("list", []) if "expr" in a]
    found += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return found


def test_the_dashboard_is_importable_json_with_the_panels_operators_expect() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    titles = [panel["title"] for panel in dashboard["panels"]]
    for expected in (
        "Writes by decision",
        "Rejections by reason",
        "Latency the gateway adds (the store's decision)",
        "Store latency by operation (p95)",
        "Unknown keys by destination",
        "In flight and overload",
        "Reloads and retention",
    ):
        assert expected in titles
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(titles)
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}"  # chosen at import
        assert panel["targets"] and all(t["expr"] for t in panel["targets"])


async def test_every_metric_the_dashboard_queries_is_exposed(tmp_path: Path) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    asked = {name for query in queries(dashboard) for name in _METRIC.findall(query)}
    assert "sinkgate_writes_total" in asked and "sinkgate_unknown_keys" in asked
    config = make_config(tmp_path, destination("payments", "http://127.0.0.1:9/api"))
    async with served(config) as info, aiohttp.ClientSession() as session:
        async with session.get(f"http://{info['admin_listen']}/metrics") as resp:
            assert resp.status == 200
            text = await resp.text()
    exposed = {
        family.name + suffix
        for family in text_string_to_metric_families(text)
        for suffix in _SUFFIXES.get(family.type, ("",))
    }
    missing = sorted(asked - exposed)
    assert not missing, f"the dashboard queries metrics /metrics does not expose: {missing}"
