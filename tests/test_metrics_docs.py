"""docs/metrics.md is generated from the registered metrics (scripts/gen_metrics_docs.py) and
is up to date; the expositions follow Prometheus' conventions and pass ``promtool check metrics``
(the cached promtool, built once like the other binaries: ``mlx-fleet provision``).

The generator runs in a subprocess: it registers the fleet collector on the default registry
and imports the operator's handlers, which must not leak into this test process.

Pure: no cluster.
"""

from __future__ import annotations

import difflib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
GENERATOR = REPO / "scripts" / "gen_metrics_docs.py"
DOC = REPO / "docs" / "metrics.md"


def _run(*args: str) -> str:
    res = subprocess.run([sys.executable, str(GENERATOR), *args], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def _generator():
    spec = importlib.util.spec_from_file_location("gen_metrics_docs", GENERATOR)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def fresh() -> str:
    """docs/metrics.md as the generator writes it from the code now."""
    return _run("--print")


def test_metrics_doc_is_up_to_date(fresh: str) -> None:
    committed = DOC.read_text() if DOC.exists() else ""
    if fresh != committed:
        diff = "".join(difflib.unified_diff(committed.splitlines(True), fresh.splitlines(True),
                                            "docs/metrics.md (committed)",
                                            "docs/metrics.md (from the code)"))
        pytest.fail("docs/metrics.md is out of date: run python scripts/gen_metrics_docs.py\n"
                    + diff)


def test_doc_lists_both_components_families(fresh: str) -> None:
    operator, agent = fresh.split("## Operator", 1)[1].split("## Node agent", 1)
    assert "| `mlxfleet_operator_revision_request_duration_seconds` | histogram | `namespace`, " \
           "`deployment`, `revision` |" in operator
    assert "| `mlxfleet_operator_reconcile_duration_seconds` | histogram | `result` |" in operator
    assert "| `mlxfleet_operator_watch_restarts_total` | counter | `watch` |" in operator
    assert "| `mlxfleet_agent_requests_total` | counter | `model`, `revision`, `endpoint`, " \
           "`code` |" in agent
    agent, router = agent.split("## Fleet router", 1)
    assert "mlxfleet_agent_" not in operator and "mlxfleet_operator_" not in agent.split(
        "|---|", 1)[1]
    assert "| `mlxfleet_router_requests_total` | counter | `model`, `code`, `tenant` |" in router
    assert "mlxfleet_agent_" not in router and "mlxfleet_operator_" not in router


def test_generator_refuses_a_metric_whose_labels_it_cannot_find() -> None:
    gen = _generator()
    registry = CollectorRegistry()
    Counter("mlxfleet_test_things_total", "things", ["kind"], registry=registry)
    with pytest.raises(SystemExit, match="mlxfleet_test_things"):
        gen._rows(registry, {})
    rows = gen._rows(registry, {"mlxfleet_test_things": ("kind",)})
    assert [(r.name, r.type, r.labels, r.help) for r in rows] == [
        ("mlxfleet_test_things_total", "counter", ("kind",), "things")]


NAME = re.compile(r"^mlxfleet_(operator|agent|router)_[a-z][a-z0-9_]*$")
UNITS = ("seconds", "bytes")


@pytest.mark.parametrize("component", ["operator", "agent", "router"])
def test_exposition_follows_conventions(component: str) -> None:
    """Without promtool: the naming rules of docs/metrics.md, on a scrape with samples in
    every family."""
    text = _run("--exposition", component)
    fams = [f for f in text_string_to_metric_families(text) if f.name.startswith("mlxfleet_")]
    names = {f.name for f in fams}
    # prometheus_client writes a counter's or histogram's *_created series as a gauge family
    fams = [f for f in fams if not (f.name.endswith("_created")
                                     and f.name.removesuffix("_created") in names)]
    assert fams
    for f in fams:
        assert NAME.match(f.name), f.name
        assert f.documentation.strip(), f.name
        assert f.samples, f"{f.name} has no samples in the sample scrape"
        if f.type == "counter":
            assert {s.name for s in f.samples} <= {f.name + "_total", f.name + "_created"}
        else:
            assert not f.name.endswith("_total"), f.name
        for unit in UNITS:  # a unit, when named, is the base unit at the end
            if unit in f.name.split("_"):
                assert f.name.endswith("_" + unit) or f.name.endswith(f"_{unit}_total"), f.name
        assert not re.search(r"_(milli|micro|kilo|mega|giga)", f.name), f.name
        if f.type == "histogram":
            series: dict[tuple, list[tuple[float, float]]] = {}
            for s in f.samples:
                if s.name.endswith("_bucket"):
                    key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
                    series.setdefault(key, []).append((float(s.labels["le"]), s.value))
            for key, buckets in series.items():
                assert [le for le, _ in buckets] == sorted(le for le, _ in buckets)
                assert buckets[-1][0] == float("inf"), (f.name, key)
                counts = [v for _, v in buckets]
                assert counts == sorted(counts), (f.name, key)  # cumulative


@pytest.fixture(scope="module")
def promtool() -> Path:
    from mlx_fleet.devcluster.prombuild import ensure_prometheus

    return ensure_prometheus().promtool


@pytest.mark.parametrize("component", ["operator", "agent", "router"])
def test_promtool_check_metrics(component: str, promtool: Path) -> None:
    text = _run("--exposition", component)
    res = subprocess.run([str(promtool), "check", "metrics"], input=text, capture_output=True,
                         text=True, timeout=60)
    # promtool prints lint findings and exits non-zero on any of them
    assert res.returncode == 0 and not res.stdout.strip(), res.stdout + res.stderr


def test_promtool_rejects_a_bad_exposition(promtool: Path) -> None:
    """The check above can fail: promtool flags a counter without ``_total``."""
    bad = "# HELP mlxfleet_test_things things\n# TYPE mlxfleet_test_things counter\n" \
          "mlxfleet_test_things 1\n"
    res = subprocess.run([str(promtool), "check", "metrics"], input=bad, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode != 0 and "_total" in res.stdout + res.stderr, res.stdout + res.stderr
