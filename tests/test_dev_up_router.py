"""``mlx-fleet dev up --router`` runs a fleet router following the dev cluster's etcd, prints its
URL, and stops it with everything else on SIGTERM."""

from __future__ import annotations

import json
import re
import sys
import urllib.request
from pathlib import Path

import pytest

from mlx_fleet.devcluster.processes import ManagedProcess

pytestmark = pytest.mark.integration

URL = re.compile(r"Fleet router \(one OpenAI endpoint for every model\): "
                 r"(http://127\.0\.0\.1:\d+)/v1")


def test_dev_up_router_serves_the_dev_fleet(tmp_path: Path) -> None:
    proc = ManagedProcess("mlx-fleet dev up", [
        sys.executable, "-m", "mlx_fleet.cli", "dev", "up", "--router",
        "--workdir", str(tmp_path / "dev")], tmp_path / "dev-up.log",
        env={"PYTHONUNBUFFERED": "1", "COLUMNS": "200"})
    try:
        found: list[str] = []

        def printed_url() -> bool:
            found[:] = URL.findall(proc.log_path.read_text())
            return bool(found)

        proc.wait_until(printed_url, timeout=120, what="printing the router URL")
        with urllib.request.urlopen(f"{found[0]}/health", timeout=5) as r:
            assert r.status == 200
        with urllib.request.urlopen(f"{found[0]}/v1/models", timeout=5) as r:
            assert json.load(r) == {"object": "list", "data": []}  # nothing deployed yet
    finally:
        assert proc.stop(grace=30) == 0, proc.log_tail()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{found[0]}/health", timeout=2)
