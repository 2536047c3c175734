"""The Grafana dashboards (mlx_fleet/dashboards) rendered to charts/mlx-fleet/dashboards/ are
up to date, every panel has a unit and queries, every query names only metrics the code exports
(docs/metrics.md, itself checked against the code by test_metrics_docs.py), and the variable
expansion used to run the queries against Prometheus behaves as Grafana's.

Pure: no cluster. That every query returns data from a real Prometheus scraping a running fleet
is tests/test_dashboards_prometheus.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_fleet.dashboards import DASHBOARDS, render_all
from mlx_fleet.dashboards.queries import expand, metric_names, panel_queries

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "charts" / "mlx-fleet" / "dashboards"


def documented_metrics() -> set[str]:
    """Metric names in docs/metrics.md's tables (counters with ``_total``)."""
    return set(re.findall(r"^\| `(mlxfleet_[a-z0-9_]+)` \|", (REPO / "docs" / "metrics.md")
                          .read_text(), re.M))


@pytest.fixture(scope="module")
def models() -> dict[str, dict]:
    return {name: json.loads(text) for name, text in render_all().items()}


def test_committed_dashboards_are_up_to_date() -> None:
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_dashboards.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, ("charts/mlx-fleet/dashboards/ is stale: run python "
                                 "scripts/gen_dashboards.py\n" + res.stderr)
    assert sorted(p.name for p in OUT.glob("*.json")) == sorted(f"{n}.json" for n in DASHBOARDS)


def test_every_panel_has_a_unit_and_a_query(models: dict[str, dict]) -> None:
    for name, model in models.items():
        panels = [p for p in model["panels"] if p["type"] != "row"]
        assert len(panels) >= 8, name
        for p in panels:
            assert p["fieldConfig"]["defaults"].get("unit"), (name, p["title"])
            assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), (name, p["title"])
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        ids = [p["id"] for p in model["panels"]]
        assert len(set(ids)) == len(ids), name
    assert len({m["uid"] for m in models.values()}) == len(models)


def test_panel_queries_refuses_a_panel_without_unit() -> None:
    model = {"panels": [{"type": "timeseries", "title": "x", "fieldConfig": {"defaults": {}},
                         "targets": [{"expr": "up"}]}]}
    with pytest.raises(ValueError, match="'x' has no unit"):
        list(panel_queries(model))


def test_queries_name_only_exported_metrics(models: dict[str, dict]) -> None:
    exported = documented_metrics()
    assert "mlxfleet_operator_nodes" in exported and "mlxfleet_agent_queue_depth" in exported
    used: set[str] = set()
    for name, model in models.items():
        for q in panel_queries(model):
            names = metric_names(q.expr)
            assert names, (name, q.panel, q.expr)
            assert names <= exported, (name, q.panel, names - exported)
            used |= names
    # the brief's panels: health, memory, models, requests, latency, canary, serving
    for must in ("mlxfleet_operator_nodes", "mlxfleet_operator_node_memory_budget_bytes",
                 "mlxfleet_operator_canary_weight", "mlxfleet_operator_canary_phase",
                 "mlxfleet_operator_revision_time_to_first_token_seconds",
                 "mlxfleet_agent_queue_depth", "mlxfleet_agent_batch_occupancy",
                 "mlxfleet_agent_prompt_cache_tokens_total"):
        assert must in used, must


@pytest.mark.parametrize("name, variables", [
    ("fleet", {"datasource", "namespace", "deployment", "node"}),
    ("canary", {"datasource", "namespace", "deployment"}),
    ("mac", {"datasource", "namespace", "deployment", "node"}),
])
def test_variables(models: dict[str, dict], name: str, variables: set[str]) -> None:
    got = {v["name"]: v for v in models[f"{name}.json"]["templating"]["list"]}
    assert set(got) == variables
    for v in got.values():
        if v["name"] != "datasource":
            assert v["query"].startswith("label_values(") and v["includeAll"] and v["multi"]
    for q in panel_queries(models[f"{name}.json"]):  # every variable a query uses is defined
        assert set(re.findall(r"\$(\w+)", q.expr)) <= variables | {"__rate_interval", "__range"}


@pytest.mark.parametrize("expr, expected", [
    ('x{namespace=~"$namespace"}', 'x{namespace=~"t-1"}'),
    ('rate(x{node=~"${node}"}[$__rate_interval])', 'rate(x{node=~"mac\\\\.a"}[5s])'),
    ("increase(x[$__range])", "increase(x[1m])"),
    ('x{deployment=~"$deployment"}', 'x{deployment=~"d\\\\+1"}'),
])
def test_expand(expr: str, expected: str) -> None:
    values = {"namespace": "t-1", "node": "mac.a", "deployment": "d+1"}
    assert expand(expr, values, rate_interval="5s", time_range="1m") == expected


def test_expand_names_a_missing_variable() -> None:
    with pytest.raises(KeyError, match=r"\$node"):
        expand('x{node=~"$node"}', {}, rate_interval="5s", time_range="1m")


@pytest.mark.parametrize("expr, names", [
    ("histogram_quantile(0.5, sum by (le) (rate(mlxfleet_agent_x_seconds_bucket[1m])))",
     {"mlxfleet_agent_x_seconds"}),
    ("mlxfleet_operator_a_bytes - mlxfleet_operator_b_bytes",
     {"mlxfleet_operator_a_bytes", "mlxfleet_operator_b_bytes"}),
    ("rate(mlxfleet_agent_requests_total[1m])", {"mlxfleet_agent_requests_total"}),
])
def test_metric_names(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_fleet_dashboard_shows_every_router_metric(models: dict[str, dict]) -> None:
    """The Router row uses each family the fleet router exports (docs/metrics.md)."""
    router = {m for m in documented_metrics() if m.startswith("mlxfleet_router_")}
    assert "mlxfleet_router_breaker_state" in router and len(router) >= 9
    used = set().union(*(metric_names(q.expr) for q in panel_queries(models["fleet.json"])))
    assert router <= used, router - used
