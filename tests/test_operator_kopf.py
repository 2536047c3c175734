"""The operator end to end on the real local control plane (etcd + kube-apiserver + CRDs).

The test plays the node agents: it writes node records (under a lease) and reports into etcd,
and watches the assignments the operator writes. No sleeps or polls: etcd changes are awaited
with an etcd watch, Kubernetes status with ``kubectl wait --for=condition=...``,
``--for=jsonpath=...`` or ``--for=delete`` (a watch on the API server).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import pytest

from fleet_helpers import asg_key, node_record, stored_assignment, stub_manifest, until_assignments
from mlx_fleet.source_policy import DEV_POLICY
from mlx_fleet.contract import AssignmentReport, AssignmentState, Keys, Role
from mlx_fleet.devcluster.processes import ManagedProcess, free_port
from mlx_fleet.store import EtcdStore

pytestmark = pytest.mark.integration
GiB = 1024**3
TIMEOUT = 60.0


@pytest.fixture
def fleet_keys() -> Keys:
    return Keys(f"/mlx-fleet-test/{uuid.uuid4().hex[:12]}")


@contextlib.contextmanager
def running_operator(control_plane, keys: Keys, namespace: str, log: Path, *extra: str):
    """The operator as a subprocess watching ``namespace``, yielded once /healthz answers;
    stopped with SIGTERM (and must exit 0) afterwards. Its source policy is the dev one (the
    stub manifests name local directories) unless ``extra`` gives another
    ``--source-policy`` (the last one wins)."""
    liveness, metrics_port = free_port(), free_port()
    proc = ManagedProcess("mlx-fleet-operator", [
        sys.executable, "-m", "mlx_fleet_operator", "--etcd-endpoint", control_plane.etcd_url,
        "--etcd-prefix", keys.root, "--metrics-port", str(metrics_port),
        "--liveness-port", str(liveness), "--namespace", namespace, "--verbose",
        "--source-policy", DEV_POLICY.to_json(), *extra],
        log, env=control_plane.env())

    def healthy() -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{liveness}/healthz", timeout=2) as r:
            return r.status == 200

    try:
        proc.wait_until(healthy, timeout=TIMEOUT, what="live (/healthz)")
        proc.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        yield proc
    finally:
        code = proc.stop()
        print(proc.log_tail(60))
        assert code == 0, f"operator exited with {code} on SIGTERM"


@pytest.fixture
def operator(control_plane, fleet_keys, namespace, tmp_path):
    with running_operator(control_plane, fleet_keys, namespace, tmp_path / "operator.log") as proc:
        yield proc


async def kubectl_wait(control_plane, namespace: str, name: str, condition: str) -> None:
    """``kubectl wait --for=<condition>`` on the ModelDeployment (a watch on the API server, no
    polling here): ``condition=Ready``, ``jsonpath={.status.x}=v`` or ``delete``."""
    r = await asyncio.to_thread(control_plane.kubectl, "wait", f"modeldeployment/{name}", "-n", namespace,
                                f"--for={condition}", f"--timeout={int(TIMEOUT)}s", check=False,
                                timeout=TIMEOUT + 30)
    if r.returncode != 0:
        last = await asyncio.to_thread(control_plane.kubectl, "get", "modeldeployment", name, "-n",
                                       namespace, "-o", "json", check=False)
        raise AssertionError(f"kubectl wait --for={condition}: {r.stderr.strip()}; last object: {last.stdout}")


async def get_object(control_plane, namespace: str, name: str) -> dict:
    r = await asyncio.to_thread(control_plane.kubectl, "get", "modeldeployment", name, "-n", namespace, "-o", "json")
    return json.loads(r.stdout)


def metric_samples(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text → {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def ready_condition(obj: dict | None) -> dict:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == "Ready":
            return c
    return {}


async def test_modeldeployment_lifecycle(control_plane, operator, fleet_keys, namespace):
    keys = fleet_keys
    name = f"llm-{uuid.uuid4().hex[:6]}"
    async with EtcdStore(control_plane.etcd_url) as store:
        lease = await store.grant_lease(60)
        await store.put(keys.node("mac-a"), node_record("mac-a").to_json(), lease=lease)

        await asyncio.to_thread(control_plane.kubectl, "apply", "-f", "-", input=stub_manifest(
            name, namespace, placement={"minChipGeneration": "M4"}))
        placed = await until_assignments(store, keys, lambda v: "mac-a" in v)
        asg = placed["mac-a"]
        assert (asg.namespace, asg.name, asg.served_model_name) == (namespace, name, name)
        assert asg.memory_bytes == GiB and asg.source.uri == "file:///models/tiny-llama"
        assert (asg.revision, asg.role) == ("v1", Role.STABLE)
        [key] = [kv.key for kv in (await store.list(keys.assignments_prefix)).items]
        assert key == keys.assignment("mac-a", namespace, name, "v1")

        # Acting as the agent: the replica is Ready.
        await store.put(keys.report("mac-a", namespace, name, "v1"), AssignmentReport(
            node="mac-a", namespace=namespace, name=name, generation=asg.generation,
            revision="v1", state=AssignmentState.READY, reason="ModelLoaded",
            endpoint="http://mac-a.local:8000").to_json(), lease=lease)
        await kubectl_wait(control_plane, namespace, name, "condition=Ready")
        await kubectl_wait(control_plane, namespace, name, "jsonpath={.status.readyReplicas}=1")
        obj = await get_object(control_plane, namespace, name)
        assert ready_condition(obj)["status"] == "True" and obj["status"]["readyReplicas"] == 1
        status = obj["status"]
        assert status["observedGeneration"] == obj["metadata"]["generation"] == asg.generation
        assert status["endpoints"] == ["http://mac-a.local:8000"]
        assert [(n["name"], n["revision"], n["role"], n["state"]) for n in status["nodes"]] == [
            ("mac-a", "v1", "Stable", "Ready")]
        assert status["updatedReplicas"] == 1
        assert "mlx-fleet.io/finalizer" in obj["metadata"]["finalizers"]

        # mac-a goes away (its agent's keys vanish), mac-b appears: the replica moves.
        lease_b = await store.grant_lease(60)
        await store.put(keys.node("mac-b"), node_record("mac-b").to_json(), lease=lease_b)
        await store.revoke_lease(lease)
        moved = await until_assignments(store, keys, lambda v: set(v) == {"mac-b"})
        assert moved["mac-b"].name == name
        # nodes are sorted by name: mac-b first means mac-a is gone from this (atomic) status.
        await kubectl_wait(control_plane, namespace, name, "jsonpath={.status.nodes[0].name}=mac-b")
        obj = await get_object(control_plane, namespace, name)
        assert [n["name"] for n in obj["status"]["nodes"]] == ["mac-b"] and obj["status"]["readyReplicas"] == 0

        events = await asyncio.to_thread(
            control_plane.kubectl, "get", "events", "-n", namespace, "--field-selector",
            f"involvedObject.name={name}", "-o", "jsonpath={.items[*].reason}")
        assert {"Placed", "ReplicaReady"} <= set(events.stdout.split())

        def scrape() -> str:
            with urllib.request.urlopen(operator.metrics_url, timeout=5) as r:
                return r.read().decode()

        text = await asyncio.to_thread(scrape)
        assert 'mlxfleet_operator_nodes{health="Healthy"} 1.0' in text
        assert f'mlxfleet_operator_deployment_replicas{{name="{name}",namespace="{namespace}",state="desired"}} 1.0' in text
        samples = metric_samples(text)
        assert samples[("mlxfleet_operator_reconcile_total", (("result", "changed"),))] >= 2  # placed, moved
        assert samples[("mlxfleet_operator_reconcile_total", (("result", "unchanged"),))] >= 1
        assert samples[("mlxfleet_operator_reconcile_duration_seconds_count",
                        (("result", "success"),))] >= 3
        assert samples[("mlxfleet_operator_etcd_txn_conflicts_total", ())] == 0  # one writer

        await asyncio.to_thread(control_plane.kubectl, "delete", "modeldeployment", name, "-n", namespace,
                                "--wait=true", "--timeout=60s")
        await until_assignments(store, keys, lambda v: not v)
        await kubectl_wait(control_plane, namespace, name, "delete")
        await store.revoke_lease(lease_b)


async def test_orphans_are_collected_with_no_modeldeployment_at_all(control_plane, fleet_keys, tmp_path):
    """The collector runs from start-up, not from the first handler call: in a namespace that
    never had a ModelDeployment, an assignment for a non-existent one is deleted; one in a
    namespace the operator does not watch stays."""
    keys = fleet_keys
    empty_ns = f"t-{uuid.uuid4().hex[:8]}"
    await asyncio.to_thread(control_plane.kubectl, "create", "namespace", empty_ns)
    try:
        with running_operator(control_plane, keys, empty_ns, tmp_path / "operator.log",
                              "--gc-interval", "0.2"):
            async with EtcdStore(control_plane.etcd_url) as store:
                elsewhere = asg_key(keys, "mac-b", "not-watched", "x")  # node → one in the view
                await store.put(elsewhere, stored_assignment("not-watched", "x", "u0"))
                await store.put(asg_key(keys, "mac-a", empty_ns, "ghost"),
                                stored_assignment(empty_ns, "ghost", "u1"))
                left = await until_assignments(store, keys, lambda v: all(
                    a.namespace != empty_ns for a in v.values()))
                assert [(a.namespace, a.name) for a in left.values()] == [("not-watched", "x")]
                assert (await store.get(elsewhere)) is not None
    finally:
        await asyncio.to_thread(control_plane.kubectl, "delete", "namespace", empty_ns,
                                "--wait=false", check=False)


# --- start-up failures exit instead of retrying forever -------------------------------------------

def run_operator_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m mlx_fleet_operator`` to completion (it must exit on its own)."""
    return subprocess.run([sys.executable, "-m", "mlx_fleet_operator", *args], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=60)


def test_unloadable_kubeconfig_exits_2_with_one_line():
    # KUBERNETES_SERVICE_HOST empty: not in a pod, so only the kubeconfig is tried.
    r = run_operator_cli({"KUBECONFIG": "/nonexistent", "KUBERNETES_SERVICE_HOST": ""},
                         "--metrics-port", "0", "--liveness-port", "0")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "kubeconfig" in lines[0] and "/nonexistent" in lines[0]


def test_metrics_port_in_use_exits_2_naming_the_port(control_plane):
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run_operator_cli(control_plane.env(), "--metrics-port", str(port), "--liveness-port", "0")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"port {port}" in lines[0] and "--metrics-port" in lines[0]


async def test_failed_startup_is_permanent_and_stops_what_it_started(etcd_server, monkeypatch):
    """A start-up handler failure after the followers started: kopf.PermanentError (kopf then
    stops the operator instead of retrying every 60 s) and no follower task or store is left."""
    import kopf

    from mlx_fleet_operator import handlers, metrics

    def port_taken(port: int) -> None:
        raise OSError(98, "Address already in use")

    closed = []
    original_close = EtcdStore.close

    async def close(self) -> None:
        closed.append(self)
        await original_close(self)

    from mlx_fleet_operator.config import OperatorConfig

    memo = kopf.Memo(config=OperatorConfig(
        etcd_endpoint=etcd_server.client_url, etcd_prefix=f"/t-{uuid.uuid4().hex[:8]}", metrics_port=1))
    monkeypatch.setattr(handlers, "kubernetes_api", lambda: object())
    monkeypatch.setattr(metrics, "serve", port_taken)
    monkeypatch.setattr(EtcdStore, "close", close)
    with pytest.raises(kopf.PermanentError, match="Address already in use"):
        await handlers.startup(settings=kopf.OperatorSettings(), logger=logging.getLogger("test"),
                               memo=memo)
    assert "runtime" not in memo and len(closed) == 1
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("etcd follower")]


async def test_a_refused_source_gets_a_condition_and_no_assignment(
        control_plane, fleet_keys, namespace, tmp_path):
    """Issue 19 (finding 2): a ModelDeployment whose source the fleet's source policy refuses
    gets ``SourceAllowed=False`` (reason ``SourceRefused``, naming the field and the rule) and
    a Warning event, and no assignment; an allowed source on the same object is placed."""
    keys = fleet_keys
    name = f"llm-{uuid.uuid4().hex[:6]}"
    policy = '{"fileRoots": ["/models"], "hfOrganizations": ["mlx-community"]}'
    obj = json.loads(stub_manifest(name, namespace))
    obj["spec"]["model"]["source"] = "hf://someone/tiny"
    with running_operator(control_plane, keys, namespace, tmp_path / "operator.log",
                          "--source-policy", policy):
        async with EtcdStore(control_plane.etcd_url) as store:
            lease = await store.grant_lease(60)
            await store.put(keys.node("mac-a"), node_record("mac-a").to_json(), lease=lease)
            await asyncio.to_thread(control_plane.kubectl, "apply", "-f", "-",
                                    input=json.dumps(obj))
            await kubectl_wait(control_plane, namespace, name, "condition=SourceAllowed=false")
            got = await get_object(control_plane, namespace, name)
            [c] = [c for c in got["status"]["conditions"] if c["type"] == "SourceAllowed"]
            assert c["reason"] == "SourceRefused"
            assert c["message"].startswith("spec.model.source: refused by the source policy: ")
            assert "hfOrganizations" in c["message"]
            assert ready_condition(got)["reason"] == "SourceRefused"
            assert (await store.list(keys.assignments_prefix)).items == []
            events = await asyncio.to_thread(
                control_plane.kubectl, "get", "events", "-n", namespace, "--field-selector",
                f"involvedObject.name={name}", "-o", "jsonpath={.items[*].reason}")
            assert "SourceRefused" in events.stdout.split()

            obj["spec"]["model"]["source"] = "file:///models/tiny-llama"  # under fileRoots
            await asyncio.to_thread(control_plane.kubectl, "apply", "-f", "-",
                                    input=json.dumps(obj))
            await kubectl_wait(control_plane, namespace, name, "condition=SourceAllowed")
            await until_assignments(store, keys, lambda v: "mac-a" in v)
            await asyncio.to_thread(control_plane.kubectl, "delete", "modeldeployment", name,
                                    "-n", namespace, "--wait=true", "--timeout=60s")
            await until_assignments(store, keys, lambda v: not v)
            await store.revoke_lease(lease)


async def test_served_name_conflict_marks_both_and_clears(control_plane, fleet_keys, namespace,
                                                          tmp_path):
    """Two ModelDeployments claiming one served name: both get ``ServedNameConflict`` True
    naming the other (and a Warning event); deleting one clears the other's. ``--router-url``
    shows in each ``status.router`` with the served name."""
    keys = fleet_keys
    router = "http://mlx-fleet-router.test:8080"
    first, second = (f"llm-{uuid.uuid4().hex[:6]}" for _ in range(2))

    def named(name: str) -> str:
        obj = json.loads(stub_manifest(name, namespace))
        obj["spec"]["model"]["servedModelName"] = "shared"
        return json.dumps(obj)

    with running_operator(control_plane, keys, namespace, tmp_path / "operator.log",
                          "--router-url", router + "/"):
        async with EtcdStore(control_plane.etcd_url) as store:
            lease = await store.grant_lease(60)
            for node in ("mac-a", "mac-b"):  # one served name per Mac: placement needs two
                await store.put(keys.node(node), node_record(node).to_json(), lease=lease)
            await asyncio.to_thread(control_plane.kubectl, "apply", "-f", "-", input=named(first))
            await kubectl_wait(control_plane, namespace, first,
                               "condition=ServedNameConflict=false")
            obj = await get_object(control_plane, namespace, first)
            assert obj["status"]["router"] == {"url": router, "model": "shared"}

            await asyncio.to_thread(control_plane.kubectl, "apply", "-f", "-", input=named(second))
            for name, other in ((first, second), (second, first)):
                await kubectl_wait(control_plane, namespace, name, "condition=ServedNameConflict")
                obj = await get_object(control_plane, namespace, name)
                [c] = [c for c in obj["status"]["conditions"] if c["type"] == "ServedNameConflict"]
                assert c["reason"] == "NameClaimedByAnother"
                assert f"{namespace}/{other}" in c["message"] and "'shared'" in c["message"]
                events = await asyncio.to_thread(
                    control_plane.kubectl, "get", "events", "-n", namespace, "--field-selector",
                    f"involvedObject.name={name}", "-o", "jsonpath={.items[*].reason}")
                assert "ServedNameConflict" in events.stdout.split()

            await asyncio.to_thread(control_plane.kubectl, "delete", "modeldeployment", second,
                                    "-n", namespace, "--wait=true", "--timeout=60s")
            await kubectl_wait(control_plane, namespace, first,
                               "condition=ServedNameConflict=false")
            await asyncio.to_thread(control_plane.kubectl, "delete", "modeldeployment", first,
                                    "-n", namespace, "--wait=true", "--timeout=60s")
            await until_assignments(store, keys, lambda v: not v)
            await store.revoke_lease(lease)
