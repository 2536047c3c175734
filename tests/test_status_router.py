"""``mlx-fleet status --router`` against a real router process on a real etcd: the breaker of a
Mac that fails its health probes shows up in the table; a refused key or an unreachable router
is one error line (exit 1) after the etcd table, which still prints."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlx_fleet.contract import (Assignment, AssignmentReport, AssignmentState, Keys,
                                ModelSource, NodeCapacity, NodeRecord)
from mlx_fleet.devcluster.controlplane import ControlPlane
from mlx_fleet.devcluster.fleet import RouterProcess, start_router
from mlx_fleet.devcluster.processes import free_port
from mlx_fleet.store import EtcdStore

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
NS, DEP, NODE = "status-ns", "chat", "mac-dead"
KEY = "status-router-key-0123456789"


async def _publish(etcd_url: str, keys: Keys, endpoint: str) -> None:
    """A Ready replica of NS/DEP on NODE, whose endpoint refuses connections."""
    async with EtcdStore(etcd_url) as store:
        await store.put(keys.node(NODE), NodeRecord(name=NODE, address=endpoint, capacity=NodeCapacity(
            memory_total_bytes=64 << 30, memory_available_bytes=60 << 30, chip="Apple M4 Max",
            chip_generation=4, simulated=True)).to_json())
        await store.put(keys.assignment(NODE, NS, DEP, "r1"), Assignment(
            namespace=NS, name=DEP, generation=1, served_model_name=DEP,
            source=ModelSource(uri="file:///m", revision="r1"), memory_bytes=1).to_json())
        await store.put(keys.report(NODE, NS, DEP, "r1"), AssignmentReport(
            node=NODE, namespace=NS, name=DEP, generation=1, revision="r1",
            state=AssignmentState.READY, endpoint=endpoint).to_json())


@pytest.fixture(scope="module")
def routed(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[RouterProcess, Keys, Path]]:
    keys = Keys(f"/mlx-fleet-status/{uuid.uuid4().hex[:8]}")
    asyncio.run(_publish(control_plane.etcd_url, keys, f"http://127.0.0.1:{free_port()}"))
    key_file = tmp_path_factory.mktemp("router") / "api-keys"
    key_file.write_text(f"{KEY}\n")
    router = start_router(control_plane, etcd_prefix=keys.root, namespaces=(NS,),
                          extra_args=("--api-key-file", str(key_file), "--probe-interval", "0.2"))

    def opened() -> bool:
        req = urllib.request.Request(f"{router.url}/fleet",
                                     headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(req, timeout=2) as r:
            return [m["state"] for m in json.load(r)["macs"]] == ["open"]

    # three failed probes (nothing listens there) open the breaker
    router.process.wait_until(opened, timeout=30, what="breaker of mac-dead open")
    yield router, keys, key_file
    router.process.stop()


def _status(cp: ControlPlane, keys: Keys, *args: str,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlx_fleet.cli", "status", "--etcd-endpoint", cp.etcd_url,
         "--etcd-prefix", keys.root, *args], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'operator'}", "COLUMNS": "250",
             **(env or {})})


def _table(stdout: str) -> list[dict[str, str]]:
    """The rows of a rich table (its default box: ``┃`` in the header, ``│`` in the body),
    each cell's wrapped lines joined by a space, keyed by the header's column names."""
    heads = [[c.strip() for c in ln.strip("┃").split("┃")]
             for ln in stdout.splitlines() if ln.startswith("┃")]
    header = [" ".join(filter(None, parts)) for parts in zip(*heads)]
    body = [[c.strip() for c in ln.strip("│").split("│")]
            for ln in stdout.splitlines() if ln.startswith("│")]
    rows: list[list[str]] = []
    for cells in body:
        if cells[0] or not rows:
            rows.append(cells)
        else:  # a wrapped line of the row above
            rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells)]
    return [dict(zip(header, r)) for r in rows]


def test_status_shows_the_routers_breakers(control_plane, routed) -> None:
    router, keys, key_file = routed
    r = _status(control_plane, keys, "--router", router.url, "--router-key-file", str(key_file))
    assert r.returncode == 0, r.stderr
    (row,) = [row for row in _table(r.stdout) if row["Node"] == NODE]
    assert (row["Deployment"], row["State"], row["In-flight"]) == (f"{NS}/{DEP}", "Ready", "0")
    assert row["Breaker"].startswith("open (HealthProbes, half-open in "), row
    # the URL from the environment, the key file too
    r = _status(control_plane, keys, env={"MLX_FLEET_ROUTER_URL": router.url,
                                          "MLX_FLEET_ROUTER_KEY_FILE": str(key_file)})
    assert r.returncode == 0, r.stderr
    (row,) = [row for row in _table(r.stdout) if row["Node"] == NODE]
    assert row["Breaker"].startswith("open (HealthProbes"), row


def test_status_without_the_key_or_router_prints_etcd_then_one_error(control_plane,
                                                                     routed) -> None:
    router, keys, _ = routed
    dead = f"http://127.0.0.1:{free_port()}"
    for url, why in ((router.url, "401"), (dead, "cannot connect")):
        r = _status(control_plane, keys, "--router", url)
        assert r.returncode == 1
        assert NODE in r.stdout and "Breaker" not in r.stdout  # the etcd table still printed
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: router ") and why in lines[0], \
            r.stderr
    # without --router: as before, no router column and exit 0
    r = _status(control_plane, keys)
    assert r.returncode == 0 and NODE in r.stdout and "Breaker" not in r.stdout
