"""Read the queries back out of a rendered dashboard and make them runnable against Prometheus'
HTTP API, which knows nothing of Grafana's variables. Pure: plain data in and out.

Used by the test that runs every panel's query against a real Prometheus and by the PNG renderer
(scripts/render_dashboards.py).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Mapping

__all__ = ["PanelQuery", "panel_queries", "expand", "metric_names"]


@dataclasses.dataclass(frozen=True)
class PanelQuery:
    """One query of one panel: ``panel`` title, its ``unit``, the PromQL ``expr`` (with Grafana
    variables) and the ``legend`` format (``{{label}}`` placeholders)."""

    panel: str
    unit: str
    expr: str
    legend: str


def panel_queries(model: Mapping) -> Iterator[PanelQuery]:
    """Every query of every panel of a Grafana dashboard JSON model, in panel order (rows
    included, collapsed or not). Raises ``ValueError`` for a panel without a unit."""
    panels = []
    for p in model.get("panels", []):
        panels.append(p)
        panels.extend(p.get("panels", []))  # a collapsed row holds its panels
    for p in panels:
        if p.get("type") == "row":
            continue
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit")
        if not unit:
            raise ValueError(f"panel {p.get('title')!r} has no unit")
        for t in p.get("targets", []):
            yield PanelQuery(p["title"], unit, t["expr"], t.get("legendFormat", ""))


def _regex_escape(value: str) -> str:
    # RE2 metacharacters, escaped for a PromQL double-quoted string (a backslash doubled)
    return re.sub(r"([.+*?()|\[\]{}^$\\])", r"\\\\\1", value)


def expand(expr: str, variables: Mapping[str, str], *, rate_interval: str,
           time_range: str) -> str:
    """``expr`` with Grafana's variables replaced as Grafana would for a single selected value:
    ``$name`` / ``${name}`` by the regex-escaped ``variables[name]``, ``$__rate_interval`` by
    ``rate_interval`` and ``$__range`` by ``time_range`` (Prometheus durations, e.g. ``"10s"``).
    Raises ``KeyError`` naming a variable that ``variables`` lacks."""
    builtins = {"__rate_interval": rate_interval, "__range": time_range}

    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name in builtins:
            return builtins[name]
        if name not in variables:
            raise KeyError(f"no value for dashboard variable ${name} in {expr!r}")
        return _regex_escape(variables[name])

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", sub, expr)


_NAME = re.compile(r"\b(mlxfleet_[a-z0-9_]+)")
_SUFFIXES = ("_bucket", "_sum", "_count")


def metric_names(expr: str) -> set[str]:
    """The mlx-fleet metric families an expression names (``_bucket``/``_sum``/``_count`` of a
    histogram map to the histogram's name)."""
    out = set()
    for name in _NAME.findall(expr):
        for suffix in _SUFFIXES:
            if name.endswith(suffix):
                name = name.removesuffix(suffix)
                break
        out.add(name)
    return out
