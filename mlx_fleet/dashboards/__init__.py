"""mlx-fleet's Grafana dashboards as code (grafana-foundation-sdk), rendered to JSON under
``charts/mlx-fleet/dashboards/`` by ``scripts/gen_dashboards.py`` (tests/test_dashboards.py
regenerates and compares).

``DASHBOARDS`` maps each file stem to the module that builds it: ``fleet`` (the Macs and the
ModelDeployments), ``canary`` (candidate vs stable), ``mac`` (one Mac's memory and serving).
"""

from __future__ import annotations

import json
from types import ModuleType

from grafana_foundation_sdk.cog.encoder import JSONEncoder

from . import canary, fleet, mac

__all__ = ["DASHBOARDS", "render", "render_all"]

DASHBOARDS: dict[str, ModuleType] = {"fleet": fleet, "canary": canary, "mac": mac}


def render(name: str) -> str:
    """The dashboard ``name`` (a key of :data:`DASHBOARDS`) as Grafana JSON text (sorted keys,
    2-space indent, trailing newline). Raises ``KeyError`` for an unknown name."""
    model = DASHBOARDS[name].build().build()
    for i, panel in enumerate(model.panels or [], start=1):  # stable ids: links, "view panel"
        panel.id_val = i
    return json.dumps(model, cls=JSONEncoder, sort_keys=True, indent=2) + "\n"


def render_all() -> dict[str, str]:
    """``{"<name>.json": JSON text}`` for every dashboard."""
    return {f"{name}.json": render(name) for name in DASHBOARDS}
