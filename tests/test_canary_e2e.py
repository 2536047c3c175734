"""Canaries and revision edits end to end, on real parts: kube-apiserver + etcd + the operator
process + two agent processes serving generated MLX models, under a steady streamed load.

* a plain revision edit is a surge rolling update: zero failed requests, ``status.endpoints``
  never empty (every status the API server sends on a watch is checked);
* a healthy candidate steps through its weights and is promoted with no reload;
* a faulty candidate (its model raises after a few tokens — the fault is in the model's files)
  is rolled back by itself, and no session hashed to the stable revision sees an error.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlx_fleet.contract import Keys
from mlx_fleet.devcluster.controlplane import ControlPlane
from mlx_fleet.devcluster.fleet import AgentProcess, start_agent, start_operator
from mlx_fleet.devcluster.kwatch import ObjectWatch
from mlx_fleet.devcluster.loadgen import LoadGenerator
from mlx_fleet.devcluster.processes import ManagedProcess
from mlx_fleet.routing.split import bucket
from mlx_fleet.store import EtcdStore

pytestmark = pytest.mark.integration

SESSIONS = [f"user-{i}" for i in range(6)]


def balanced_sessions(namespace: str, name: str, weight: int = 50, each: int = 3) -> list[str]:
    """Session keys with ``each`` on both sides of ``weight`` for this deployment (the namespace
    is random per run, so a fixed list could leave a side without traffic — every window then
    Inconclusive, and the canary rightly holds)."""
    sides: dict[bool, list[str]] = {True: [], False: []}
    for i in range(10_000):
        key = f"user-{i}"
        side = bucket(f"{namespace}/{name}", key) < weight * 100
        if len(sides[side]) < each:
            sides[side].append(key)
        if all(len(v) == each for v in sides.values()):
            return sides[True] + sides[False]
    raise AssertionError("no balanced sessions found")


@pytest.fixture(scope="module")
def canary_keys() -> Keys:
    return Keys(f"/mlx-fleet-canary/{uuid.uuid4().hex[:8]}")


@pytest.fixture(scope="module")
def canary_fleet(control_plane: ControlPlane, canary_keys: Keys,
                 namespace: str) -> Iterator[dict[str, AgentProcess]]:
    op: ManagedProcess = start_operator(control_plane, etcd_prefix=canary_keys.root,
                                        extra_args=("--namespace", namespace))
    agents = {n: start_agent(control_plane, n, etcd_prefix=canary_keys.root, memory="64Gi",
                             lease_ttl=3) for n in ("mac-c1", "mac-c2")}
    yield agents
    control_plane.kubectl("delete", "canaries", "--all", "-n", namespace, "--wait=true",
                          "--timeout=60s", check=False, timeout=70)
    control_plane.kubectl("delete", "modeldeployments", "--all", "-n", namespace, "--wait=true",
                          "--timeout=60s", check=False, timeout=70)
    for a in agents.values():
        a.process.stop()
    op.stop()


@pytest.fixture(scope="module")
def faulty_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mlx_fleet.testmodel import Fault, make_test_model

    return make_test_model(tmp_path_factory.mktemp("models") / "faulty",
                           fault=Fault("raise", after_tokens=2))


def deployment(name: str, namespace: str, model_dir: Path, revision: str) -> str:
    return json.dumps({
        "apiVersion": "mlx-fleet.io/v1alpha1", "kind": "ModelDeployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"model": {"source": str(model_dir), "revision": revision},
                 "replicas": 2, "resources": {"memory": "1Gi"}}})


#: Two revisions of one tiny model on a shared two-core runner: their p95 latencies differ by
#: scheduling jitter alone, often by more than the default 1.5× in a 2-second window. These tests
#: are about the step machine on real parts, so latency is judged by absolute limits here; the
#: relative rules are table-tested (tests/test_analysis.py).
CPU_NOISE = {"latencyP95": {"maxSeconds": 5}, "ttftP95": {"maxSeconds": 5},
             "tokensPerSecond": {"min": 1}}


def canary(name: str, namespace: str, target: str, revision: str, source: Path | None,
           steps: list[dict]) -> str:
    candidate: dict = {"revision": revision}
    if source is not None:
        candidate["source"] = str(source)
    return json.dumps({
        "apiVersion": "mlx-fleet.io/v1alpha1", "kind": "Canary",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"targetRef": {"name": target}, "candidate": candidate, "steps": steps,
                 "analysis": {"interval": "2s", "minRequests": 3, "checks": CPU_NOISE}}})


def get(cp: ControlPlane, kind: str, namespace: str, name: str) -> dict:
    return json.loads(cp.kubectl("get", kind, name, "-n", namespace, "-o", "json").stdout)


def wait_for(cp: ControlPlane, kind: str, namespace: str, name: str, cond: str,
             timeout: int = 120) -> dict:
    done = cp.kubectl("wait", f"--for={cond}", f"{kind}/{name}", "-n", namespace,
                      f"--timeout={timeout}s", timeout=timeout + 10, check=False)
    obj = get(cp, kind, namespace, name)
    assert done.returncode == 0, (f"{kind}/{name} never reached {cond}: "
                                  f"{json.dumps(obj.get('status'), indent=1)}")
    return obj


async def test_revision_edit_under_load_fails_no_request(
        control_plane: ControlPlane, canary_fleet: dict, test_model_dir: Path,
        namespace: str) -> None:
    name = "edit-under-load"
    control_plane.kubectl("apply", "-f", "-", input=deployment(name, namespace, test_model_dir, "v1"))
    md = wait_for(control_plane, "modeldeployment", namespace, name, "condition=Ready")
    endpoints = list(md["status"]["endpoints"])
    assert len(endpoints) == 2
    watch = ObjectWatch(control_plane, "modeldeployment", name, namespace)
    try:
        async with LoadGenerator(lambda: endpoints, name, sessions=SESSIONS) as load:
            await load.wait_for(10)
            control_plane.kubectl("patch", "modeldeployment", name, "-n", namespace,
                                  "--type=merge", "-p", '{"spec": {"model": {"revision": "v2"}}}')
            # (in a thread: the load generator keeps sending on the event loop meanwhile; the
            # edit is seen first, else the old status would satisfy the waits below)
            await asyncio.to_thread(wait_for, control_plane, "modeldeployment", namespace, name,
                                    "jsonpath={.status.observedGeneration}=2")
            await asyncio.to_thread(wait_for, control_plane, "modeldeployment", namespace, name,
                                    "jsonpath={.status.updatedReplicas}=2")
            await asyncio.to_thread(
                wait_for, control_plane, "modeldeployment", namespace, name,
                "jsonpath={.status.conditions[?(@.type=='Progressing')].reason}=Complete")
            await load.wait_for(10)
        outcomes = load.outcomes
    finally:
        watch.stop()
    failed = [o for o in outcomes if o.failed]
    assert not failed, failed[:3]
    served = {o.revision for o in outcomes}
    assert served == {"v1", "v2"}, served  # both revisions answered, none failed
    assert outcomes[-1].revision == "v2"
    after_ready = [s for s in watch.statuses if s.get("readyReplicas")]
    assert after_ready, "the watch saw no status"
    assert all(s.get("endpoints") for s in after_ready), [s.get("endpoints") for s in after_ready]
    md = get(control_plane, "modeldeployment", namespace, name)
    assert {(n["name"], n["revision"], n["role"]) for n in md["status"]["nodes"]} == {
        ("mac-c1", "v2", "Stable"), ("mac-c2", "v2", "Stable")}


async def test_healthy_candidate_is_promoted_through_every_step(
        control_plane: ControlPlane, canary_fleet: dict, canary_keys: Keys, test_model_dir: Path,
        namespace: str) -> None:
    name, can = "promote-me", "promote-me-v2"
    control_plane.kubectl("apply", "-f", "-", input=deployment(name, namespace, test_model_dir, "v1"))
    md = wait_for(control_plane, "modeldeployment", namespace, name, "condition=Ready")
    endpoints = list(md["status"]["endpoints"])
    async with LoadGenerator(lambda: endpoints, name,
                             sessions=balanced_sessions(namespace, name)) as load:
        await load.wait_for(6)
        control_plane.kubectl("apply", "-f", "-", input=canary(
            can, namespace, name, "v2", None, [{"setWeight": 50}, {"setWeight": 100}]))
        obj = await asyncio.to_thread(wait_for, control_plane, "canary", namespace, can,
                                      "jsonpath={.status.phase}=Succeeded", 180)
        await load.wait_for(6)
    outcomes = load.outcomes
    assert not [o for o in outcomes if o.failed], [o for o in outcomes if o.failed][:3]
    assert {"v1", "v2"} <= {o.revision for o in outcomes}
    assert obj["status"]["currentWeight"] == 100
    md = get(control_plane, "modeldeployment", namespace, name)
    assert md["spec"]["model"]["revision"] == "v2"
    events = control_plane.kubectl("get", "events", "-n", namespace, "--field-selector",
                                   f"involvedObject.name={can}", "-o", "json").stdout
    reasons = [e["reason"] for e in json.loads(events)["items"]]
    assert "Promoting" in reasons and "Succeeded" in reasons, reasons
    table = control_plane.kubectl("get", "canaries", "-n", namespace).stdout
    assert can in table and "Succeeded" in table and "100" in table
    async with EtcdStore(control_plane.etcd_url) as store:
        # the split is gone: everything is the (new) stable revision
        assert await store.get(canary_keys.traffic(namespace, name)) is None


async def test_faulty_candidate_is_rolled_back_and_stable_sessions_see_no_error(
        control_plane: ControlPlane, canary_fleet: dict, test_model_dir: Path,
        faulty_model_dir: Path, namespace: str) -> None:
    name, can = "rollback-me", "rollback-me-bad"
    control_plane.kubectl("apply", "-f", "-", input=deployment(name, namespace, test_model_dir, "v1"))
    md = wait_for(control_plane, "modeldeployment", namespace, name, "condition=Ready")
    endpoints = list(md["status"]["endpoints"])
    weight = 50
    sessions = [f"s-{i}" for i in range(40)]
    to_candidate = {s for s in sessions if bucket(f"{namespace}/{name}", s) < weight * 100}
    assert 0 < len(to_candidate) < len(sessions)
    async with LoadGenerator(lambda: endpoints, name, sessions=sessions[:12]) as load:
        await load.wait_for(6)
        control_plane.kubectl("apply", "-f", "-", input=canary(
            can, namespace, name, "bad", faulty_model_dir,
            [{"setWeight": weight}, {"setWeight": 100}]))
        obj = await asyncio.to_thread(wait_for, control_plane, "canary", namespace, can,
                                      "jsonpath={.status.phase}=RolledBack", 180)
        await load.wait_for(6)
    outcomes = load.outcomes
    stable_failures = [o for o in outcomes if o.failed and o.session not in to_candidate]
    assert not stable_failures, stable_failures[:3]
    assert any(o.failed and o.revision == "bad" for o in outcomes)  # the fault did fire
    assert obj["status"]["currentWeight"] == 0
    assert get(control_plane, "modeldeployment", namespace, name)["spec"]["model"][
        "revision"] == "v1"
    # the candidate is unloaded everywhere (after the endpoint grace that follows the removal
    # of its traffic split), and the two stable replicas stay
    with ObjectWatch(control_plane, "modeldeployment", name, namespace) as watch:
        md = await asyncio.to_thread(watch.wait, lambda o: {
            n["revision"] for n in (o.get("status") or {}).get("nodes") or []} == {"v1"}, 60)
    assert md["status"]["replicas"] == 2 and md["status"]["readyReplicas"] == 2


def cli(cp: ControlPlane, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mlx_fleet.cli", "canary", *args],
                          env={**os.environ, **cp.env()}, capture_output=True, text=True,
                          timeout=60)


async def test_manual_pause_promote_and_abort_with_the_cli(
        control_plane: ControlPlane, canary_fleet: dict, canary_keys: Keys,
        test_model_dir: Path, namespace: str) -> None:
    name, can = "manual", "manual-v2"
    control_plane.kubectl("apply", "-f", "-", input=deployment(name, namespace, test_model_dir, "v1"))
    md = wait_for(control_plane, "modeldeployment", namespace, name, "condition=Ready")
    endpoints = list(md["status"]["endpoints"])
    async with LoadGenerator(lambda: endpoints, name,
                             sessions=balanced_sessions(namespace, name)) as load:
        await load.wait_for(6)
        control_plane.kubectl("apply", "-f", "-", input=canary(
            can, namespace, name, "v2", None,
            [{"setWeight": 50}, {"pause": {}}, {"setWeight": 100}, {"pause": {}}]))
        await asyncio.to_thread(wait_for, control_plane, "canary", namespace, can,
                                "jsonpath={.status.phase}=Paused", 120)
        shown = cli(control_plane, "status", can, "-n", namespace)
        assert shown.returncode == 0 and "Paused" in shown.stdout and "weight 50%" in shown.stdout
        # a manual pause waits: promote moves it past the pause to the next step
        assert cli(control_plane, "promote", can, "-n", namespace).returncode == 0
        await asyncio.to_thread(wait_for, control_plane, "canary", namespace, can,
                                "jsonpath={.status.currentStepIndex}=3", 120)
        assert get(control_plane, "canary", namespace, can)["status"]["currentWeight"] == 100
        assert cli(control_plane, "abort", can, "-n", namespace).returncode == 0
        obj = await asyncio.to_thread(wait_for, control_plane, "canary", namespace, can,
                                      "jsonpath={.status.phase}=Aborted", 120)
        await load.wait_for(6)
    assert obj["status"]["currentWeight"] == 0
    assert not [o for o in load.outcomes if o.failed]
    assert get(control_plane, "modeldeployment", namespace, name)["spec"]["model"][
        "revision"] == "v1"
    async with EtcdStore(control_plane.etcd_url) as store:
        assert await store.get(canary_keys.traffic(namespace, name)) is None
    # abort with nothing in progress is a no-op that still succeeds
    assert cli(control_plane, "abort", can, "-n", namespace).returncode == 0
    missing = cli(control_plane, "abort", "no-such-canary", "-n", namespace)
    assert missing.returncode == 1 and "not found" in missing.stderr
