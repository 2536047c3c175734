"""Nodes vanishing together on a real operator (issue 8 §2, "etcd frozen"): etcd revokes the
agents' leases as it resumes from a freeze, so every node record goes at once; the agents
re-register a moment later. The operator must hold their replicas — no assignment deleted —
instead of re-placing them in between. Here the mass revocation is caused directly (two leases
revoked back to back on the real etcd), which is what the frozen-etcd fault does only
sometimes; the rule itself is table-tested in tests/test_disruption.py."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from fleet_helpers import node_record, stub_manifest, until_assignments
from mlx_fleet.contract import AssignmentReport, AssignmentState
from mlx_fleet.devcluster.fleet import start_operator
from mlx_fleet.store import EtcdStore, follow_prefix

TIMEOUT = 60.0
NODES = ("mac-hold-a", "mac-hold-b", "mac-hold-c")


async def until_logged(path, offset: int, text: str, timeout: float = TIMEOUT) -> str:
    """The first line containing ``text`` written to ``path`` after ``offset`` (a process log
    offers nothing to await: read again every 50 ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with path.open("rb") as f:
            f.seek(offset)
            for line in f.read().decode(errors="replace").splitlines():
                if text in line:
                    return line
        await asyncio.sleep(0.05)
    raise TimeoutError(f"{text!r} not logged in {timeout:.0f} s; see {path}")


@pytest.mark.fault(
    "etcd frozen (SIGSTOP) 20 s: every node record vanishing at once as etcd resumes",
    holds="the operator holds the vanished nodes' replicas (none deleted, none moved); a node "
          "back is released at once, a reconcile meanwhile keeps the held one's replica")
async def test_replicas_of_nodes_vanishing_together_are_held_not_re_placed(
        control_plane, namespace, keys, fault_record):
    log_path = control_plane.logs_dir / "operator-disruption.log"
    proc = start_operator(control_plane, etcd_prefix=keys.root, log_name="operator-disruption",
                          extra_args=("--namespace", namespace, "--standalone"))
    name = f"llm-{uuid.uuid4().hex[:6]}"
    try:
        async with EtcdStore(control_plane.etcd_url) as store:
            leases = {n: await store.grant_lease(60) for n in NODES}
            for n in NODES:
                await store.put(keys.node(n), node_record(n).to_json(), lease=leases[n])
            r = await asyncio.to_thread(control_plane.kubectl, "apply", "-f", "-",
                                        input=stub_manifest(name, namespace, replicas=2),
                                        check=False)
            assert r.returncode == 0, r.stderr
            placed = await until_assignments(store, keys, lambda v: len(v) == 2, timeout=TIMEOUT)
            holders = sorted(placed)  # two of the three Macs
            for n in holders:  # Ready reports under the same leases, as agents write them:
                # revoked with the node records, they wake the deployment at that moment
                await store.put(keys.report(n, namespace, name, "v1"), AssignmentReport(
                    node=n, namespace=namespace, name=name, revision="v1",
                    generation=placed[n].generation, state=AssignmentState.READY,
                    endpoint=f"http://{n}.local:8000").to_json(), lease=leases[n])
            deletes: list[str] = []
            following = asyncio.Event()

            async def on_snapshot(snap) -> None:
                following.set()

            async def on_event(ev) -> None:
                if ev.type == "DELETE":
                    deletes.append(ev.kv.key)

            follower = asyncio.create_task(
                follow_prefix(store, keys.assignments_prefix, on_snapshot, on_event))
            try:
                await asyncio.wait_for(following.wait(), TIMEOUT)
                offset = log_path.stat().st_size
                for n in holders:  # what etcd does to every expired lease as it resumes
                    await store.revoke_lease(leases[n])
                fault_record.fault_ended()
                held = await until_logged(log_path, offset, "control-plane disruption")
                assert all(n in held for n in holders), held
                # one agent re-registers: released at once; the other is still away (held)
                leases[holders[0]] = await store.grant_lease(60)
                await store.put(keys.node(holders[0]), node_record(holders[0]).to_json(),
                                lease=leases[holders[0]])
                back = await until_logged(log_path, offset, "held node(s) back")
                assert holders[0] in back
                fault_record.recovered()
                # a reconcile after both: scaled to 3, the third replica lands on the spare
                # Mac — and the held Mac's replica is still assigned, not moved there
                r = await asyncio.to_thread(
                    control_plane.kubectl, "patch", "modeldeployment", name, "-n", namespace,
                    "--type=merge", "-p", '{"spec":{"replicas":3}}', check=False)
                assert r.returncode == 0, r.stderr
                spare = next(n for n in NODES if n not in holders)
                now = await until_assignments(store, keys, lambda v: spare in v, timeout=TIMEOUT)
                assert sorted(now) == sorted(NODES)
                assert deletes == []  # no replica was dropped at any moment
                fault_record.note("2 of 3 node records revoked together: both held, none of "
                                  "their assignments deleted; the one re-registered released, "
                                  "a scale-up meanwhile kept the still-missing one's replica")
            finally:
                follower.cancel()
                await asyncio.gather(follower, return_exceptions=True)
    finally:
        control_plane.kubectl("delete", "modeldeployment", name, "-n", namespace,
                              "--wait=false", check=False)
        proc.stop()
