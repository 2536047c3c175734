"""Drain end to end, on real parts: kube-apiserver + etcd + the operator process + two agent
processes serving a generated MLX model, under a steady streamed load.

* ``mlx-fleet drain A`` moves the replica from A to B with zero failed requests (the clients
  follow ``status.endpoints`` as the API server sends it), and A keeps no assignment;
* a deployment that fits nowhere is refused: ``Scheduled=False``/``Unschedulable`` with the
  numbers, visible with kubectl;
* a drain that cannot finish (nowhere else fits) leaves the replica serving where it is, and
  ``mlx-fleet drain --timeout`` exits 1 with the reason on one line;
* a deployment without ``resources.memory`` gets one replica first, then the rest with the
  agent's reported estimate as the reservation.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet_helpers import watch_until
from mlx_fleet.contract import Keys
from mlx_fleet.devcluster.controlplane import ControlPlane
from mlx_fleet.devcluster.fleet import AgentProcess, start_agent, start_operator
from mlx_fleet.devcluster.kwatch import ObjectWatch
from mlx_fleet.devcluster.loadgen import LoadGenerator
from mlx_fleet.store import EtcdStore

pytestmark = pytest.mark.integration

A, B = "mac-d1", "mac-d2"  # equal Macs: placement's tie-break by name puts a replica on A


@pytest.fixture(scope="module")
def drain_keys() -> Keys:
    return Keys(f"/mlx-fleet-drain/{uuid.uuid4().hex[:8]}")


@pytest.fixture(scope="module")
def drain_fleet(control_plane: ControlPlane, drain_keys: Keys,
                namespace: str) -> Iterator[dict[str, AgentProcess]]:
    op = start_operator(control_plane, etcd_prefix=drain_keys.root,
                        extra_args=("--namespace", namespace))
    agents = {n: start_agent(control_plane, n, etcd_prefix=drain_keys.root, memory="16Gi",
                             lease_ttl=3) for n in (A, B)}
    yield agents
    control_plane.kubectl("delete", "modeldeployments", "--all", "-n", namespace, "--wait=true",
                          "--timeout=60s", check=False, timeout=70)
    for a in agents.values():
        a.process.stop()
    op.stop()
    for n in (A, B):
        control_plane.kubectl("delete", "macnode", n, "--wait=false", check=False)


def deployment(name: str, namespace: str, model_dir: Path, memory: str = "1Gi") -> str:
    return json.dumps({
        "apiVersion": "mlx-fleet.io/v1alpha1", "kind": "ModelDeployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"model": {"source": str(model_dir), "revision": "v1"}, "replicas": 1,
                 "resources": {"memory": memory}}})


def get(cp: ControlPlane, kind: str, name: str, namespace: str | None = None) -> dict:
    ns = ["-n", namespace] if namespace else []
    return json.loads(cp.kubectl("get", kind, name, *ns, "-o", "json").stdout)


def wait_for(cp: ControlPlane, kind: str, name: str, cond: str, namespace: str | None = None,
             timeout: int = 90) -> dict:
    ns = ["-n", namespace] if namespace else []
    done = cp.kubectl("wait", f"--for={cond}", f"{kind}/{name}", *ns, f"--timeout={timeout}s",
                      timeout=timeout + 10, check=False)
    obj = get(cp, kind, name, namespace)
    assert done.returncode == 0, f"{kind}/{name} never reached {cond}: {obj.get('status')}"
    return obj


def condition(obj: dict, ctype: str) -> dict:
    return next(c for c in obj["status"]["conditions"] if c["type"] == ctype)


async def cli(cp: ControlPlane, *args: str) -> tuple[int, str, str]:
    """``mlx-fleet ARGS`` as a user runs it, without blocking the event loop (the load runs)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "mlx_fleet.cli", *args, env={**os.environ, **cp.env()},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_drain_under_load_moves_the_replica_and_fails_no_request(
        control_plane: ControlPlane, drain_fleet: dict[str, AgentProcess], drain_keys: Keys,
        test_model_dir: Path, namespace: str) -> None:
    name = "drain-me"
    control_plane.kubectl("apply", "-f", "-", input=deployment(name, namespace, test_model_dir))
    md = wait_for(control_plane, "modeldeployment", name, "condition=Ready", namespace)
    assert [n["name"] for n in md["status"]["nodes"]] == [A]
    first = list(md["status"]["endpoints"])
    watch = ObjectWatch(control_plane, "modeldeployment", name, namespace)

    def endpoints() -> list[str]:  # the clients follow status.endpoints as the server sends it
        seen = [s.get("endpoints") for s in watch.statuses if s.get("endpoints") is not None]
        return seen[-1] if seen else first

    try:
        async with LoadGenerator(endpoints, name, sessions=[f"s{i}" for i in range(4)]) as load:
            await load.wait_for(8)
            code, out, err = await cli(control_plane, "drain", A, "--timeout", "90")
            assert code == 0, (out, err)
            await load.wait_for(8)
        outcomes = load.outcomes
    finally:
        watch.stop()
    failed = [o for o in outcomes if o.failed]
    assert not failed, failed[:3]
    a_url, b_url = drain_fleet[A].url, drain_fleet[B].url
    assert {o.endpoint for o in outcomes} == {a_url, b_url}  # served on A, then on B
    assert outcomes[-1].endpoint == b_url
    assert all(s.get("endpoints") for s in watch.statuses if s.get("readyReplicas"))
    # before its assignment went, A was withdrawn: still listed, out of the endpoints
    withdrawn = [s for s in watch.statuses
                 if any(n.get("reason") == "Withdrawn" for n in s.get("nodes", []))]
    assert withdrawn and all(s["endpoints"] == [b_url] for s in withdrawn), watch.statuses
    # the drain command returns once A's assignments are gone; the status follows (entries are
    # sorted by node name, so B first means A is no longer listed)
    md = wait_for(control_plane, "modeldeployment", name,
                  f"jsonpath={{.status.nodes[0].name}}={B}", namespace)
    assert [(n["name"], n["state"]) for n in md["status"]["nodes"]] == [(B, "Ready")]
    async with EtcdStore(control_plane.etcd_url) as store:
        assert not (await store.list(drain_keys.node_assignments_prefix(A))).items
    mac = get(control_plane, "macnode", A)
    assert mac["spec"] == {"unschedulable": True, "drain": True}
    assert (condition(mac, "Drained")["status"], condition(mac, "Drained")["reason"]) == (
        "True", "Drained")
    assert "Drained" in control_plane.kubectl("get", "macnode", A).stdout  # printer column


async def test_unschedulable_deployment_and_a_drain_that_cannot_finish(
        control_plane: ControlPlane, drain_fleet: dict[str, AgentProcess], drain_keys: Keys,
        test_model_dir: Path, namespace: str) -> None:
    # fits nowhere: refused with the numbers (16 GiB Macs: a 12.8 GiB budget each)
    big = "too-big"
    control_plane.kubectl("apply", "-f", "-",
                          input=deployment(big, namespace, test_model_dir, memory="100Gi"))
    md = wait_for(control_plane, "modeldeployment", big,
                  "jsonpath={.status.conditions[?(@.type=='Scheduled')].reason}=Unschedulable",
                  namespace)
    sched = condition(md, "Scheduled")
    assert sched["status"] == "False"
    assert "insufficient memory (needs 100.0GiB" in sched["message"], sched
    assert B in sched["message"] and "free of 12.8GiB" in sched["message"], sched
    control_plane.kubectl("delete", "modeldeployment", big, "-n", namespace, "--wait=true",
                          "--timeout=60s")

    # A cordoned (its drain, if the test above ran, ended): B alone serves; drain B: nowhere to go
    control_plane.kubectl("patch", "macnode", A, "--type=merge", "-p",
                          '{"spec": {"unschedulable": true, "drain": false}}')
    name = "stuck"
    control_plane.kubectl("apply", "-f", "-", input=deployment(name, namespace, test_model_dir))
    wait_for(control_plane, "modeldeployment", name, "condition=Ready", namespace)
    try:
        code, _, err = await cli(control_plane, "drain", B, "--timeout", "4")
        assert code == 1
        [line] = err.strip().splitlines()
        assert line.startswith(f"error: drain of {B} not done after 4s: DrainBlocked: "), line
        assert f"{namespace}/{name}" in line and "v1 on mac-d2 cannot move" in line, line
        md = get(control_plane, "modeldeployment", name, namespace)
        assert [(n["name"], n["state"]) for n in md["status"]["nodes"]] == [(B, "Ready")]
        assert md["status"]["endpoints"] == [drain_fleet[B].url]  # still serving
        sched = condition(md, "Scheduled")
        assert (sched["status"], sched["reason"]) == ("False", "Unschedulable")
        assert "1 draining" in sched["message"] and "1 cordoned" in sched["message"], sched
    finally:
        code, _, err = await cli(control_plane, "uncordon", B)
        assert code == 0, err
    mac = wait_for(control_plane, "macnode", B,
                   "jsonpath={.status.conditions[?(@.type=='Drained')].reason}=DrainNotRequested")
    assert mac["spec"] == {"unschedulable": False, "drain": False}
    # the CRD refuses a drain without the cordon
    bad = control_plane.kubectl("patch", "macnode", B, "--type=merge", "-p",
                                '{"spec": {"drain": true}}', check=False)
    assert bad.returncode != 0 and "spec.drain requires spec.unschedulable" in bad.stderr


async def test_deployment_without_memory_is_placed_from_the_agents_estimate(
        control_plane: ControlPlane, drain_fleet: dict[str, AgentProcess], drain_keys: Keys,
        test_model_dir: Path, namespace: str) -> None:
    for mac in (A, B):
        code, _, err = await cli(control_plane, "uncordon", mac)
        assert code == 0, err
    name = "estimated"
    obj = json.loads(deployment(name, namespace, test_model_dir))
    del obj["spec"]["resources"]
    obj["spec"]["replicas"] = 2
    prefix = drain_keys.assignments_prefix
    seen: list[dict[str, int]] = []  # every state of this deployment's assignments, in order
    listed = asyncio.Event()

    def record(raw: dict[str, bytes]) -> bool:
        listed.set()  # first called on the initial listing: the watch follows from there
        mine = {drain_keys.parse_assignment(k)[0]: json.loads(v)["memory_bytes"]
                for k, v in raw.items() if drain_keys.parse_assignment(k)[2] == name}
        if not seen or seen[-1] != mine:
            seen.append(mine)
        return len(mine) == 2 and all(mine.values())

    async with EtcdStore(control_plane.etcd_url) as store:
        placed = asyncio.create_task(watch_until(store, prefix, record, timeout=90))
        await listed.wait()
        control_plane.kubectl("apply", "-f", "-", input=json.dumps(obj))
        await placed
        md = await asyncio.to_thread(wait_for, control_plane, "modeldeployment", name,
                                     "jsonpath={.status.readyReplicas}=2", namespace)
        reports = {n: json.loads((await store.get(drain_keys.report(n, namespace, name, "v1"))).value)
                   for n in (A, B)}
    # one replica first, reserving nothing yet; the second once the first one's estimate came
    first = next(s for s in seen if s)
    assert len(first) == 1 and list(first.values()) == [0], seen
    estimate = max(r["estimated_bytes"] for r in reports.values())
    assert estimate > 0
    assert seen[-1] == {A: estimate, B: estimate}, seen
    assert condition(md, "Scheduled")["reason"] == "Scheduled"
