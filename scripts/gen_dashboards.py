#!/usr/bin/env python3
"""Render the Grafana dashboards (mlx_fleet/dashboards, dashboards as code) to JSON files in
charts/mlx-fleet/dashboards/, which the chart ships as ConfigMaps for Grafana's sidecar.

    python scripts/gen_dashboards.py            # write the files
    python scripts/gen_dashboards.py --check    # exit 1, listing the stale files, if they differ

tests/test_dashboards.py fails when the committed files differ from what this writes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "charts" / "mlx-fleet" / "dashboards"


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(REPO))
    from mlx_fleet.dashboards import render_all

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only compare; exit 1 when stale")
    args = p.parse_args(argv)
    files = render_all()
    stale = [n for n, text in files.items()
             if not (OUT / n).exists() or (OUT / n).read_text() != text]
    extra = sorted(f.name for f in OUT.glob("*.json") if f.name not in files)
    if args.check:
        for n in stale + extra:
            print(f"stale: {OUT / n}", file=sys.stderr)
        return 1 if stale or extra else 0
    OUT.mkdir(parents=True, exist_ok=True)
    for n in extra:
        (OUT / n).unlink()
    for n, text in files.items():
        (OUT / n).write_text(text)
    print(f"wrote {len(files)} dashboards to {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
