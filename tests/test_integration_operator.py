"""The operator against the real control plane (etcd + kube-apiserver) and its fencing on the
real etcd: what the in-memory store and the fake Kubernetes APIs can't stand in for.

The logic of each part runs without etcd in its own file; here are:

- MacNodes (from tests/test_macnodes.py): the operator as a process mirroring a node record
  into a MacNode and honouring its cordon, the model limit and the watermark; the CLI's cordon
  of a MacNode the API server doesn't have;
- the fenced placement transaction on the real etcd (tests/test_operator_reconcile.py's
  fencing tests — a stale read losing, a competing write in the middle of a read, a dozen
  reconciles racing — run there on the in-memory store, and here, the same test functions, on
  etcd: its compare-on-mod_revision is what the in-memory store imitates).

The operator under kopf end to end is tests/test_operator_kopf.py. No fixed sleeps: the API
server is awaited with ``kubectl wait``, etcd with a watch.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid

import pytest

import test_operator_reconcile as reconcile_tests
from fleet_helpers import node_record, stub_manifest, until_assignments
from mlx_fleet.contract import Keys
from mlx_fleet.store import EtcdStore

pytestmark = pytest.mark.integration
GiB = 1024**3


# -- MacNodes on the real control plane (from tests/test_macnodes.py) --------------------------

def test_cli_cordon_of_an_unknown_node_is_a_readable_error(control_plane, capsys):
    from mlx_fleet.cli import main

    os.environ.setdefault("KUBECONFIG", str(control_plane.kubeconfig))
    code = main(["cordon", "no-such-mac", "--kubeconfig", str(control_plane.kubeconfig)])
    assert code == 1
    assert "macnode 'no-such-mac' not found" in capsys.readouterr().err


async def kwait(control_plane, obj: str, condition: str, namespace: str | None = None) -> None:
    ns = ["-n", namespace] if namespace else []
    r = await asyncio.to_thread(control_plane.kubectl, "wait", obj, *ns, f"--for={condition}",
                                "--timeout=60s", check=False, timeout=90)
    if r.returncode != 0:
        last = await asyncio.to_thread(control_plane.kubectl, "get", obj, *ns, "-o", "json",
                                       check=False)
        raise AssertionError(f"kubectl wait {obj} --for={condition}: {r.stderr.strip()}; "
                             f"last: {last.stdout}")


async def test_macnode_mirror_and_cordon(control_plane, keys, namespace, tmp_path):
    from test_operator_kopf import running_operator

    mac = f"mac-{uuid.uuid4().hex[:6]}"
    kc = str(control_plane.kubeconfig)
    from mlx_fleet.cli import main as cli

    with running_operator(control_plane, keys, namespace, tmp_path / "operator.log"):
        async with EtcdStore(control_plane.etcd_url) as store:
            lease = await store.grant_lease(60)
            record = node_record(mac)
            record = record.model_copy(update={"capacity": record.capacity.model_copy(
                update={"max_loaded_models": 1,  # the agent's --max-loaded-models 1
                        "memory_watermark": 0.5})})  # and --memory-watermark 0.5
            await store.put(keys.node(mac), record.to_json(), lease=lease)
            try:
                # the operator may not have created it yet: a wait for a field of a missing
                # object fails at once (NotFound), so wait for its creation first
                await kwait(control_plane, f"macnode/{mac}", "create")
                await kwait(control_plane, f"macnode/{mac}", "jsonpath={.status.health}=Healthy")
                r = await asyncio.to_thread(control_plane.kubectl, "get", "macnodes", mac)
                row = r.stdout.splitlines()
                assert row[0].split()[:4] == ["NAME", "CHIP", "GEN", "HEALTH"], r.stdout
                assert mac in row[1] and "Apple M4 Max" in row[1] and "Healthy" in row[1]
                # the limit survives the CRD's schema and shows in the wide listing
                await kwait(control_plane, f"macnode/{mac}",
                            "jsonpath={.status.maxLoadedModels}=1")
                # so does the watermark, with the budget it gives (half of 64 GiB)
                await kwait(control_plane, f"macnode/{mac}",
                            "jsonpath={.status.memoryWatermark}=0.5")
                await kwait(control_plane, f"macnode/{mac}",
                            f"jsonpath={{.status.memoryBudgetBytes}}={32 * GiB}")
                wide = await asyncio.to_thread(control_plane.kubectl, "get", "macnodes", mac,
                                               "-o", "wide")
                header, line = wide.stdout.splitlines()[:2]
                assert "MAX MODELS" in header and "WATERMARK" in header, wide.stdout
                assert "0B / 32.0GiB" in line and " 0.5 " in line, wide.stdout

                # cordon: once the operator applies it, a new deployment is not placed there
                assert await asyncio.to_thread(cli, ["cordon", mac, "--kubeconfig", kc]) == 0
                await kwait(control_plane, f"macnode/{mac}", "jsonpath={.status.unschedulable}=true")
                name = f"llm-{uuid.uuid4().hex[:6]}"
                await asyncio.to_thread(control_plane.kubectl, "apply", "-f", "-",
                                        input=stub_manifest(name, namespace))
                await kwait(control_plane, f"modeldeployment/{name}",
                            "condition=Degraded", namespace)
                obj = json.loads((await asyncio.to_thread(
                    control_plane.kubectl, "get", "modeldeployment", name, "-n", namespace,
                    "-o", "json")).stdout)
                [deg] = [c for c in obj["status"]["conditions"] if c["type"] == "Degraded"]
                assert deg["reason"] == "FailedPlacement" and "1 cordoned" in deg["message"]
                assert not (await store.list(keys.assignments_prefix)).items

                # uncordon: placed
                assert await asyncio.to_thread(cli, ["uncordon", mac, "--kubeconfig", kc]) == 0
                placed = await until_assignments(store, keys, lambda v: mac in v)
                assert placed[mac].name == name
                await kwait(control_plane, f"macnode/{mac}", "jsonpath={.status.modelCount}=1")

                # at its limit of one model: a second deployment is not placed, with the reason
                second = f"llm-{uuid.uuid4().hex[:6]}"
                await asyncio.to_thread(control_plane.kubectl, "apply", "-f", "-",
                                        input=stub_manifest(second, namespace))
                await kwait(control_plane, f"modeldeployment/{second}",
                            "condition=Degraded", namespace)
                obj = json.loads((await asyncio.to_thread(
                    control_plane.kubectl, "get", "modeldeployment", second, "-n", namespace,
                    "-o", "json")).stdout)
                [deg] = [c for c in obj["status"]["conditions"] if c["type"] == "Degraded"]
                assert deg["reason"] == "FailedPlacement"
                assert f"1 at its model limit ({mac} 1 of 1 models)" in deg["message"]

                # the record expires: the MacNode stays, Gone
                await store.revoke_lease(lease)
                await kwait(control_plane, f"macnode/{mac}", "jsonpath={.status.health}=Gone")
            finally:
                await asyncio.to_thread(control_plane.kubectl, "delete", "macnode", mac,
                                        "--wait=false", check=False)


# -- the fenced placement transaction on the real etcd (tests/test_operator_reconcile.py) ------
# The same test functions as there (on the in-memory store), called with the real etcd's store.


async def test_stale_read_loses_and_retries(etcd_store: EtcdStore, keys: Keys) -> None:
    await reconcile_tests.test_stale_read_loses_and_retries(etcd_store, keys)


@pytest.mark.parametrize("after_read", [1, 2, 3], ids=["after-1st-read", "after-2nd-read",
                                                       "after-3rd-read"])
async def test_write_during_read_never_overcommits(etcd_store: EtcdStore, keys: Keys,
                                                   after_read: int) -> None:
    await reconcile_tests.test_write_during_read_never_overcommits(etcd_store, keys, after_read)


async def test_concurrent_reconciles_after_node_death_all_converge(etcd_store: EtcdStore,
                                                                   keys: Keys) -> None:
    await reconcile_tests.test_concurrent_reconciles_after_node_death_all_converge(etcd_store, keys)
