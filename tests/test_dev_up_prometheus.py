"""``mlx-fleet dev up --operator --agents 1 --router --prometheus`` runs a Prometheus that
scrapes the operator, the agent and the fleet router, prints its URL, and stops it with
everything else on SIGTERM."""

from __future__ import annotations

import re
import sys
import urllib.request
from pathlib import Path

import pytest

from mlx_fleet.devcluster.processes import ManagedProcess
from mlx_fleet.devcluster.promserver import AGENT_JOB, OPERATOR_JOB, ROUTER_JOB, PrometheusServer

pytestmark = pytest.mark.integration

URL = re.compile(r"Prometheus \(operator \+ agents \+ router, every 5 s\): "
                 r"(http://127\.0\.0\.1:\d+)")


def test_dev_up_prometheus_scrapes_the_dev_fleet(tmp_path: Path) -> None:
    proc = ManagedProcess("mlx-fleet dev up", [
        sys.executable, "-m", "mlx_fleet.cli", "dev", "up", "--operator", "--agents", "1",
        "--router", "--prometheus", "--workdir", str(tmp_path / "dev")], tmp_path / "dev-up.log",
        env={"PYTHONUNBUFFERED": "1", "COLUMNS": "200"})
    try:
        found: list[str] = []

        def printed_url() -> bool:
            found[:] = URL.findall(proc.log_path.read_text())
            return bool(found)

        proc.wait_until(printed_url, timeout=120, what="printing the Prometheus URL")
        prom = PrometheusServer(url=found[0], process=proc, config_path=Path())
        prom.wait_for_scrapes(1, timeout=30)
        up = {(s["metric"]["job"], s["metric"].get("node")): s["value"][1]
              for s in prom.query("up")}
        assert up == {(OPERATOR_JOB, None): "1", (AGENT_JOB, "mac-0"): "1",
                      (ROUTER_JOB, None): "1"}
        assert prom.query('mlxfleet_operator_node_info{node="mac-0"}')
    finally:
        assert proc.stop(grace=30) == 0, proc.log_tail()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{found[0]}/-/ready", timeout=2)
