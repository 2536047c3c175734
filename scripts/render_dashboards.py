#!/usr/bin/env python3
"""Draw each Grafana dashboard of charts/mlx-fleet/dashboards/ as a PNG, from Prometheus data
recorded on a real local fleet, so a reader sees what each dashboard shows (no Grafana server
runs here). One image per dashboard, panels laid out on Grafana's 24-column grid, each drawn
from its own queries' results with its unit.

Record a sample (a real Prometheus scraping the operator and an agent under load, a Canary
stepped from 50 % to promoted), then draw:

    MLX_FLEET_DASHBOARD_SAMPLE=docs/dashboards/sample.json \\
      python -m pytest tests/test_dashboards_prometheus.py
    python scripts/render_dashboards.py            # needs matplotlib (pip install matplotlib)

Reads the dashboards' JSON and the sample only (not the dashboards' Python code), and refuses a
sample that lacks a query of a panel (re-record it after changing a dashboard).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DASHBOARDS = REPO / "charts" / "mlx-fleet" / "dashboards"
OUT = REPO / "docs" / "dashboards"

_ROW_UNITS = 30  # Grafana: one grid row is 30 px
_IEC = [(2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "B")]


def unit_scale(unit: str, peak: float) -> tuple[float, str]:
    """``(divisor, axis label)`` to show values of Grafana ``unit`` whose largest is ``peak``."""
    if unit == "bytes":
        for size, name in _IEC:
            if peak >= size:
                return size, name
        return 1, "B"
    if unit == "s":
        return (1e-3, "ms") if peak < 1 else (1, "s")
    if unit == "percentunit":
        return 0.01, "%"
    if unit.startswith("suffix:"):
        return 1, unit.split(":", 1)[1].strip()
    return 1, {"percent": "%", "reqps": "req/s", "ops": "ops/s", "none": ""}.get(unit, unit)


def legend(fmt: str, labels: dict[str, str]) -> str:
    hidden = {"__name__", "job", "instance"}
    if not fmt:
        return ", ".join(f"{k}={v}" for k, v in sorted(labels.items()) if k not in hidden)
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip()


def _series(result: list[dict], start: float) -> list[tuple[dict, list[float], list[float]]]:
    out = []
    for s in result:
        ts = [float(t) - start for t, _ in s["values"]]
        vs = [float(v) for _, v in s["values"]]
        out.append((s["metric"], ts, vs))
    return out


def draw(dashboard: dict, sample: dict, name: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.style.use("dark_background")
    by_panel: dict[tuple[str, str], list[dict]] = {}
    for q in sample["queries"]:
        by_panel.setdefault((q["dashboard"], q["panel"]), []).append(q)
    start, end = sample["start"], sample["end"]
    panels = dashboard["panels"]
    height = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    height += 1  # room for the last row's axis labels
    fig = plt.figure(figsize=(18, height * _ROW_UNITS / 80), facecolor="#111217")
    fig.suptitle(f"{dashboard['title']}  —  recorded on a local fleet, "
                 f"{end - start:.0f} s, variables: "
                 + ", ".join(f"{k}={v}" for k, v in sample["variables"].items()),
                 color="#d8d9da", fontsize=13, y=0.995)
    for p in panels:
        g = p["gridPos"]
        left, width = g["x"] / 24, g["w"] / 24
        bottom, tall = 1 - (g["y"] + g["h"]) / height, g["h"] / height
        if p["type"] == "row":
            fig.text(left + 0.005, bottom + tall / 2, p["title"], color="#6e9fff",
                     fontsize=12, weight="bold", va="center")
            continue
        pad = 0.08 if p["type"] == "state-timeline" else 0.03  # room for the series names
        ax = fig.add_axes((left + pad, bottom + 0.7 * tall / g["h"],
                           width - pad - 0.015, tall * (1 - 1.6 / g["h"])),
                          facecolor="#181b1f")
        queries = by_panel.get((name, p["title"]))
        if not queries or [q.get("template") for q in queries] != [t["expr"] for t in
                                                                    p["targets"]]:
            raise SystemExit(f"{name} / {p['title']}: not in the sample; re-record it "
                             "(see this script's docstring)")
        unit = p["fieldConfig"]["defaults"]["unit"]
        data = [(legend(q["legend"], m), ts, vs) for q in queries
                for m, ts, vs in _series(q["result"], start)]
        finite = [v for _, _, vs in data for v in vs if math.isfinite(v)]
        div, label = unit_scale(unit, max((abs(v) for v in finite), default=0))
        ax.set_title(f"{p['title']}" + (f"  [{label}]" if label else ""), fontsize=9,
                     color="#d8d9da", loc="left")
        ax.tick_params(labelsize=7, colors="#9fa7b3")
        for spine in ax.spines.values():
            spine.set_color("#2c3235")
        if p["type"] == "stat":
            ax.axis("off")
            text = "   ".join(f"{lg}: {vs[-1] / div:.4g}" for lg, _, vs in data if vs)
            ax.text(0.5, 0.45, text, ha="center", va="center", fontsize=15, color="#73bf69",
                    weight="bold", transform=ax.transAxes)
        elif p["type"] == "table":
            ax.axis("off")
            rows = [legend("", m) for q in queries for m, _, _ in _series(q["result"], start)]
            ax.text(0.01, 0.95, "\n".join(rows) or "(no rows)", va="top", fontsize=8,
                    family="monospace", color="#d8d9da", transform=ax.transAxes)
        elif p["type"] == "state-timeline":
            labels = sorted({lg for lg, _, _ in data})
            for i, lg in enumerate(labels):
                for lg2, ts, vs in data:
                    if lg2 == lg:
                        ax.broken_barh([(t, sample["step"]) for t, v in zip(ts, vs) if v],
                                       (i - 0.4, 0.8), color=f"C{i}")
            ax.set_yticks(range(len(labels)), labels, fontsize=7)
            ax.set_xlim(0, end - start)
        else:
            for i, (lg, ts, vs) in enumerate(data):
                ax.plot(ts, [v / div for v in vs], label=lg, linewidth=1.4, color=f"C{i % 10}")
            ax.set_xlim(0, end - start)
            if p["fieldConfig"]["defaults"].get("min") == 0:
                ax.set_ylim(bottom=0)
            if data:
                ax.legend(fontsize=6, loc="upper left", framealpha=0.3, ncol=2)
        if p["type"] in ("timeseries", "state-timeline"):
            ax.set_xlabel("seconds since the fleet came up", fontsize=7, color="#9fa7b3")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80, facecolor=fig.get_facecolor())
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sample", type=Path, default=OUT / "sample.json")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    sample = json.loads(args.sample.read_text())
    for path in sorted(DASHBOARDS.glob("*.json")):
        target = args.out / f"{path.stem}.png"
        draw(json.loads(path.read_text()), sample, path.name, target)
        print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
