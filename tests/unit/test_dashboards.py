"""The checked-in Grafana dashboard is what the generator writes, and every panel is documented."""

from __future__ import annotations

import json

from shared.tools import gen_dashboards


def test_dashboard_file_is_fresh():
    assert gen_dashboards.main(["--check"]) == 0, "run python -m shared.tools.gen_dashboards"


def test_every_panel_has_unit_description_and_queries():
    dashboard = json.loads(gen_dashboards.DASHBOARD_PATH.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert [p["title"] for p in dashboard["panels"] if p["type"] == "row"] == [r for r, _ in gen_dashboards.ROWS]
    for p in panels:
        assert p["description"] and p["fieldConfig"]["defaults"]["unit"], p["title"]
        assert p["targets"] and all(t["expr"] for t in p["targets"]), p["title"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    names = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"pool", "instance"} <= names
