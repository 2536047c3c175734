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

from fleet_helpers import node_record, stub_manifest, until_assignments
from mlx_fleet.contract import Assignment, AssignmentReport, AssignmentState, Keys, Role
from mlx_fleet.devcluster.processes import ManagedProcess, free_port
from mlx_fleet.store import EtcdStore, Snapshot, WatchEvent

pytestmark = pytest.mark.integration
GiB = 1024**3
TIMEOUT = 60.0


@pytest.fixture
def fleet_keys() -> Keys:
    return Keys(f"/mlx-fleet-test/{uuid.uuid4().hex[:12]}")


@contextlib.contextmanager
def running_operator(control_plane, keys: Keys, namespace: str, log: Path, *extra: str):
    """The operator as a subprocess watching ``namespace``, yielded once /healthz answers;
    stopped with SIGTERM (and must exit 0) afterwards."""
    liveness, metrics_port = free_port(), free_port()
    proc = ManagedProcess("mlx-fleet-operator", [
        sys.executable, "-m", "mlx_fleet_operator", "--etcd-endpoint", control_plane.etcd_url,
        "--etcd-prefix", keys.root, "--metrics-port", str(metrics_port),
        "--liveness-port", str(liveness), "--namespace", namespace, "--verbose", *extra],
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


async def test_followers_wake_only_on_relevant_changes():
    """Heartbeats must not re-place anything; a node that appears, changes or goes wakes the
    deployments it concerns (a replica on it, or something left unplaced), not every one; a
    changed report wakes its deployment."""
    from mlx_fleet.store import KV
    from mlx_fleet_operator.runtime import Runtime

    keys = Keys("/t")
    rt = Runtime(store=None, keys=keys, writer="test")  # the followers' callbacks only
    views = rt.views
    wake = rt.deployment(("default", "llm")).wake          # a replica on mac-a
    other = rt.deployment(("default", "other")).wake       # a replica left unplaced
    settled = rt.deployment(("default", "settled")).wake   # fully placed on mac-b
    rt.deployment(("default", "llm")).placed = {("mac-a", "v1"): None}
    rt.deployment(("default", "settled")).placed = {("mac-b", "v1"): None}
    rt.deployment(("default", "other")).unsettled = True
    rec = node_record("mac-a")

    def ev(key: str, value: bytes, rev: int, type_: str = "PUT") -> WatchEvent:
        return WatchEvent(type=type_, kv=KV(key=key, value=value, mod_revision=rev))

    await views.on_nodes_snapshot(Snapshot(items=[], revision=1))
    wake.clear(), other.clear(), settled.clear()  # a snapshot that changes the fleet wakes all
    await views.on_nodes_event(ev(keys.node("mac-a"), rec.to_json(), 2))
    assert wake.is_set() and other.is_set() and set(rt.nodes) == {"mac-a"}
    assert not settled.is_set()
    wake.clear(), other.clear()
    beat = rec.model_copy(update={"heartbeat_unix": rec.heartbeat_unix + 5})
    await views.on_nodes_event(ev(keys.node("mac-a"), beat.to_json(), 3))
    assert not wake.is_set() and not other.is_set()
    await views.on_nodes_event(ev(keys.node("mac-a"), b"", 4, "DELETE"))
    # judged a moment later, with whatever else vanished by then (disruption.py); meanwhile
    # its replicas are held
    assert rt.nodes == {} and rt.held_nodes() == {"mac-a"} and not wake.is_set()
    rt.holds.judge()  # what the timer runs: one node of one gone is node loss
    assert wake.is_set() and other.is_set() and not settled.is_set()
    assert rt.held_nodes() == frozenset()
    wake.clear(), other.clear()

    # Reports are per (node, revision); a changed one wakes the deployment and its Canary.
    canary = rt.canary_wakeup(("default", "llm"))
    report_key = keys.report("mac-a", "default", "llm", "v2")
    report = AssignmentReport(node="mac-a", namespace="default", name="llm", revision="v2",
                              state=AssignmentState.LOADING)
    await views.on_reports_event(ev(report_key, report.to_json(), 5))
    assert wake.is_set() and canary.is_set() and not other.is_set()
    assert rt.reports[("default", "llm")] == {("mac-a", "v2"): report}
    wake.clear(), canary.clear()
    later = report.model_copy(update={"updated_unix": report.updated_unix + 1})
    await views.on_reports_event(ev(report_key, later.to_json(), 6))
    assert not wake.is_set() and not canary.is_set()
    await views.on_reports_event(ev(report_key, b"", 7, "DELETE"))
    assert wake.is_set() and canary.is_set() and rt.reports[("default", "llm")] == {}


async def test_nodes_vanishing_together_are_held_and_released_when_back_or_after_the_hold(
        monkeypatch):
    """Most nodes vanishing within the judging window (etcd revoking every lease as it resumes
    from a freeze): their replicas are held, not re-placed; a node back is released at once, one
    still missing when the hold ends is re-placed then. A lone node lost is re-placed."""
    from mlx_fleet.store import KV
    from mlx_fleet_operator import holds
    from mlx_fleet_operator.runtime import Runtime

    monkeypatch.setattr(holds, "HOLD_SECONDS", 30.0)
    keys = Keys("/t")
    now = [100.0]
    rt = Runtime(store=None, keys=keys, writer="test", clock=lambda: now[0])
    views = rt.views
    names = ("mac-a", "mac-b", "mac-c")
    recs = {n: node_record(n) for n in names}
    wakes = {n: rt.deployment(("default", n)).wake for n in names}  # one deployment per node
    for n in names:
        rt.deployment(("default", n)).placed = {(n, "v1"): None}

    def ev(name: str, rev: int, gone: bool = False) -> WatchEvent:
        return WatchEvent(type="DELETE" if gone else "PUT", kv=KV(
            key=keys.node(name), value=b"" if gone else recs[name].to_json(), mod_revision=rev))

    def judge() -> None:
        rt.holds.judge()  # what its timer runs (cancelled)

    await views.on_nodes_snapshot(Snapshot(items=[ev(n, 1).kv for n in names], revision=1))
    for w in wakes.values():
        w.clear()
    try:
        await views.on_nodes_event(ev("mac-a", 2, gone=True))
        await views.on_nodes_event(ev("mac-b", 3, gone=True))
        judge()  # 2 of 3 gone within the window: a disruption
        assert rt.held_nodes() == {"mac-a", "mac-b"}
        assert not any(w.is_set() for w in wakes.values())  # nothing re-placed

        now[0] += 0.05
        await views.on_nodes_event(ev("mac-a", 4))  # re-registered: released at once
        assert rt.held_nodes() == {"mac-b"} and wakes["mac-a"].is_set()
        assert not wakes["mac-b"].is_set()

        now[0] += 30.0  # the hold ends with mac-b still missing: its replicas are re-placed
        rt.holds.observe()  # what the hold timer runs (cancelled)
        assert rt.held_nodes() == frozenset() and wakes["mac-b"].is_set()
        assert not wakes["mac-c"].is_set()

        for w in wakes.values():
            w.clear()
        await views.on_nodes_event(ev("mac-c", 5, gone=True))  # 1 of 2: node loss
        assert rt.held_nodes() == {"mac-c"}  # (until judged)
        judge()
        assert rt.held_nodes() == frozenset() and wakes["mac-c"].is_set()
    finally:
        rt.holds.close()


async def test_stats_follower_keeps_the_view_and_wakes_the_canary_on_a_guard_trip_only():
    """stats/<node>/<ns>/<name> fills Runtime.stats; only a report that newly trips the local
    guard wakes the Canary daemon at once (routine stats wait for its next tick)."""
    from mlx_fleet.contract import StatsReport
    from mlx_fleet.store import KV
    from mlx_fleet_operator.runtime import Runtime

    keys = Keys("/t")
    rt = Runtime(store=None, keys=keys, writer="test")
    views = rt.views
    canary = rt.canary_wakeup(("default", "llm"))
    key = keys.stats("mac-a", "default", "llm")

    def ev(value: bytes, rev: int, type_: str = "PUT") -> WatchEvent:
        return WatchEvent(type=type_, kv=KV(key=key, value=value, mod_revision=rev))

    routine = StatsReport(node="mac-a", namespace="default", name="llm", canary_uid="c1")
    tripped = routine.model_copy(update={"guard_tripped": True, "guard_reason": "3/4 failed"})
    await views.on_stats_snapshot(Snapshot(items=[], revision=1))
    await views.on_stats_event(ev(routine.to_json(), 2))
    assert rt.stats == {("default", "llm"): {"mac-a": routine}} and not canary.is_set()
    await views.on_stats_event(ev(tripped.to_json(), 3))
    assert rt.stats[("default", "llm")]["mac-a"] == tripped and canary.is_set()
    canary.clear()
    await views.on_stats_event(ev(tripped.model_copy(update={"updated_unix": 1.0}).to_json(), 4))
    assert not canary.is_set()  # still tripped: not a new trip
    await views.on_stats_event(ev(b"", 5, "DELETE"))
    assert rt.stats[("default", "llm")] == {}


async def test_conflict_rearms_the_daemon(monkeypatch):
    """A reconcile that gives up on etcd conflicts wakes its daemon again soon (not only at the
    30 s resync)."""
    import kopf

    from mlx_fleet_operator import sync
    from mlx_fleet_operator.reconcile import ConflictError
    from mlx_fleet_operator.runtime import Runtime

    async def always_conflict(*args, **kwargs):
        raise ConflictError("ns/llm: lost", conflicts=8)

    rt = Runtime(store=None, keys=Keys("/t"), writer="test")
    monkeypatch.setattr(sync, "reconcile", always_conflict)
    monkeypatch.setattr(sync, "CONFLICT_RETRY_SECONDS", 0.0)
    wake = rt.deployment(("ns", "llm")).wake
    body = {"metadata": {"namespace": "ns", "name": "llm", "generation": 1, "uid": "u"},
            "spec": {"model": {"source": "file:///m", "revision": "v1"},
                     "resources": {"memory": "1Gi"}}}
    with pytest.raises(kopf.TemporaryError):
        await sync.sync(rt, body, logging.getLogger("test"))
    await asyncio.wait_for(wake.wait(), 10)


async def test_supervisor_restarts_a_failing_follower_with_backoff(caplog):
    """A follower that raises is logged, marked dead while backing off (liveness fails), and
    restarted with growing delays; cancellation still stops it."""
    from mlx_fleet.supervise import TaskHealth, dead, supervise

    health = TaskHealth("etcd follower: nodes")
    runs = 0
    delays: list[float] = []
    dead_while_sleeping: list[bool] = []
    running = asyncio.Event()

    async def follower():
        nonlocal runs
        runs += 1
        if runs <= 3:
            raise ConnectionError(f"etcd went away #{runs}")
        running.set()
        await asyncio.Event().wait()  # healthy: runs until cancelled

    async def fake_sleep(delay: float) -> None:
        delays.append(delay)
        dead_while_sleeping.append(bool(dead([health])))

    task = asyncio.create_task(supervise(health, follower, base=0.5, cap=1.5, sleep=fake_sleep,
                                         clock=lambda: 0.0))
    await asyncio.wait_for(running.wait(), TIMEOUT)
    assert delays == [0.5, 1.0, 1.5] and dead_while_sleeping == [True, True, True]
    assert health.alive and health.restarts == 3 and "etcd went away #3" in health.last_error
    assert sum("etcd follower: nodes failed" in r.getMessage() and r.exc_info is not None
               for r in caplog.records) == 3
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not health.alive


async def test_liveness_probe_fails_while_a_follower_is_dead(monkeypatch):
    import kopf

    from mlx_fleet_operator import handlers
    from mlx_fleet_operator.runtime import Runtime
    from mlx_fleet.supervise import TaskHealth

    rt = Runtime(store=None, keys=Keys("/t"), writer="test")
    memo = kopf.Memo(runtime=rt)
    rt.followers = {"a": TaskHealth("a", alive=True), "b": TaskHealth("b", alive=True)}
    assert await handlers.probe_followers(memo=memo) == {"a": 0, "b": 0}
    rt.followers["b"] = TaskHealth("b", alive=False, restarts=2, last_error="boom")
    with pytest.raises(kopf.PermanentError, match="b.*boom"):
        await handlers.probe_followers(memo=memo)
    with pytest.raises(kopf.TemporaryError, match="starting"):  # before start-up ran
        await handlers.probe_followers(memo=kopf.Memo())


def stored_assignment(ns: str, name: str, uid: str) -> bytes:
    from mlx_fleet.contract import ModelSource

    return Assignment(namespace=ns, name=name, uid=uid, served_model_name=name,
                      source=ModelSource(uri="/m", revision="v1"), memory_bytes=GiB).to_json()


def asg_key(keys: Keys, node: str, ns: str, name: str) -> str:
    """The key of :func:`stored_assignment` (revision v1)."""
    return keys.assignment(node, ns, name, "v1")


async def test_orphan_gc_uses_the_live_listing_and_watched_namespaces(store, keys):
    """collect_orphans deletes assignments of objects missing from the API server's listing,
    only in watched namespaces, and does nothing without a listing or when listing fails."""
    from mlx_fleet_operator import orphan_gc as gc
    from mlx_fleet_operator.config import OperatorConfig
    from mlx_fleet_operator.runtime import Runtime

    a = stored_assignment
    await store.put(asg_key(keys, "mac-a", "watched", "live"), a("watched", "live", "u1"))
    await store.put(asg_key(keys, "mac-a", "watched", "gone"), a("watched", "gone", "u2"))
    await store.put(asg_key(keys, "mac-a", "elsewhere", "x"), a("elsewhere", "x", "u3"))
    cfg = OperatorConfig(namespaces=("watch*",))
    rt = Runtime(store=store, keys=keys, writer="test", in_scope=cfg.in_scope)
    assert await gc.collect_orphans(rt) == []  # no listing: hands off

    def listing_fails():
        raise gc.ListingError("ApiException: (503) Service Unavailable")

    rt = Runtime(store=store, keys=keys, writer="test", in_scope=cfg.in_scope,
                 list_live=listing_fails)
    assert await gc.collect_orphans(rt) == []  # listing failed: hands off
    assert len((await store.list(keys.assignments_prefix)).items) == 3
    rt = Runtime(store=store, keys=keys, writer="test", in_scope=cfg.in_scope,
                 list_live=lambda: {("watched", "live"): {"u1"}})
    assert await gc.collect_orphans(rt) == [asg_key(keys, "mac-a", "watched", "gone")]
    left = sorted(kv.key for kv in (await store.list(keys.assignments_prefix)).items)
    assert left == sorted([asg_key(keys, "mac-a", "elsewhere", "x"),
                           asg_key(keys, "mac-a", "watched", "live")])


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


async def test_runtime_close_abandons_a_task_that_ignores_cancellation(store, keys, monkeypatch, caplog):
    """Closing never hangs: a task that swallows its cancellation is logged by name after the
    close timeout and abandoned, and the store is still closed."""
    from mlx_fleet_operator import runtime
    from mlx_fleet_operator.runtime import Runtime

    monkeypatch.setattr(runtime, "CLOSE_TIMEOUT_SECONDS", 0.2)
    rt = Runtime(store=store, keys=keys, writer="test")
    release, started = asyncio.Event(), asyncio.Event()

    async def stubborn() -> None:
        try:
            started.set()
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await release.wait()  # ignores the cancellation until released

    rt.tasks.append(asyncio.create_task(stubborn(), name="stubborn"))
    await started.wait()  # so the cancel lands inside its try
    closed = []
    monkeypatch.setattr(store, "close", lambda: closed.append(True) or asyncio.sleep(0))
    with caplog.at_level(logging.WARNING):
        await rt.close()
    assert closed == [True]
    assert "'stubborn' did not stop within 0 s" in caplog.text
    release.set()
    await rt.tasks[0]


async def test_invalid_spec_warns_once_and_status_keeps_the_placed_replicas(store, keys, monkeypatch):
    """A spec that becomes invalid: one InvalidSpec Warning (not one from status and another
    from the handler), and status still shows the replica placed for the last valid spec —
    its assignment stays in etcd and its agent keeps serving it."""
    import kopf

    from mlx_fleet_operator import handlers
    from mlx_fleet_operator.runtime import Runtime

    patched: list[dict] = []
    posted: list[tuple[str, str]] = []

    async def patch_status(key, status):
        patched.append(dict(status))

    rt = Runtime(store=store, keys=keys, writer="test", patch_status=patch_status)
    monkeypatch.setattr(kopf, "event", lambda body, *, type, reason, message: posted.append((type, reason)))
    monkeypatch.setattr(kopf, "warn", lambda body, *, reason, message: posted.append(("Warning", reason)))
    await store.put(keys.node("mac-a"), node_record("mac-a").to_json())
    await store.put(asg_key(keys, "mac-a", "ns", "llm"), stored_assignment("ns", "llm", "u"))
    rt.reports[("ns", "llm")] = {("mac-a", "v1"): AssignmentReport(
        node="mac-a", namespace="ns", name="llm", generation=0, revision="v1",
        state=AssignmentState.READY, endpoint="http://mac-a.local:8000")}
    body = {"metadata": {"namespace": "ns", "name": "llm", "generation": 2, "uid": "u"},
            "spec": {"model": {"source": "file:///m", "revision": "v1"}, "replicas": 1,
                     "resources": {"memory": "lots"}}}
    with pytest.raises(kopf.PermanentError, match="invalid quantity"):
        await handlers.reconcile_handler(body=body, logger=logging.getLogger("test"),
                                         namespace="ns", name="llm", memo=kopf.Memo(runtime=rt))
    assert [p for p in posted if p[1] == "InvalidSpec"] == [("Warning", "InvalidSpec")]
    await rt.flush_status(("ns", "llm"))  # (patched by the status writer a moment later)
    [status] = patched
    assert status["replicas"] == 1 and status["readyReplicas"] == 1
    assert [(n["name"], n["state"]) for n in status["nodes"]] == [("mac-a", "Ready")]
    assert {c["type"]: c["reason"] for c in status["conditions"]}["Degraded"] == "InvalidSpec"
    assert (await store.get(asg_key(keys, "mac-a", "ns", "llm"))) is not None  # still served


async def test_status_patches_coalesce_and_a_resync_of_nothing_writes_nothing(store, keys,
                                                                              monkeypatch):
    """Statuses computed in quick succession (replica placed, then Ready) become one patch of
    the latest; a re-sync with nothing changed writes nothing to etcd and patches nothing."""
    import kopf

    from mlx_fleet_operator import status_writer
    from mlx_fleet_operator.runtime import Runtime
    from mlx_fleet_operator.sync import sync

    monkeypatch.setattr(status_writer, "STATUS_COALESCE_SECONDS", 3600.0)  # flushed by hand
    patched: list[dict] = []

    async def patch_status(key, status):
        patched.append(dict(status))

    rt = Runtime(store=store, keys=keys, writer="test", patch_status=patch_status)
    monkeypatch.setattr(kopf, "event", lambda body, **_: None)
    await store.put(keys.node("mac-a"), node_record("mac-a").to_json())
    key = ("ns", "llm")
    body = {"metadata": {"namespace": "ns", "name": "llm", "generation": 1, "uid": "u"},
            "spec": {"model": {"source": "file:///m", "revision": "v1"}, "replicas": 1,
                     "resources": {"memory": "1Gi"}}}
    log = logging.getLogger("test")
    await sync(rt, body, log)  # placed: not Ready yet
    assert rt.deployment(key).status.pending["readyReplicas"] == 0 and patched == []
    rt.reports[key] = {("mac-a", "v1"): AssignmentReport(
        node="mac-a", namespace="ns", name="llm", generation=1, revision="v1",
        state=AssignmentState.READY, endpoint="http://mac-a.local:8000")}
    await sync(rt, body, log)  # Ready
    await rt.flush_status(key)
    assert [p["readyReplicas"] for p in patched] == [1]  # one patch: the latest status

    before = (await store.list(keys.nodes_prefix)).revision
    for _ in range(3):  # the daemon's resyncs
        await sync(rt, body, log)
    assert rt.deployment(key).status.pending is None
    await rt.flush_status(key)
    assert len(patched) == 1
    assert (await store.list(keys.nodes_prefix)).revision == before  # no etcd write at all
    rt.forget(key)


async def test_a_deleted_deployment_is_forgotten_in_one_place():
    """Runtime.forget drops everything kept about a deployment at once: its record (spec,
    placement, drain, withdrawn replicas, status) leaves every view built from the records,
    and its queued status is never patched (its writer is cancelled)."""
    from mlx_fleet_operator import status_writer
    from mlx_fleet_operator.rollout import DrainState
    from mlx_fleet_operator.runtime import Runtime

    patched: list[dict] = []

    async def patch_status(key, status):
        patched.append(dict(status))

    rt = Runtime(store=None, keys=Keys("/t"), writer="test", patch_status=patch_status)
    key, other = ("ns", "gone"), ("ns", "kept")
    for k in (key, other):
        rt.deployment(k).reconciled({("mac-a", "v1"): None}, unsettled=True,
                                    drain=DrainState(moving=(("mac-a", "v1"),), blocked="full"))
    rt.queue_status(key, {"readyReplicas": 0})
    writer = rt.deployment(key).status.writer
    rt.forget(key)
    assert rt.existing(key) is None and rt.synced(key) is None
    assert set(rt.placed) == set(rt.drains()) == rt.unsettled == {other}
    with pytest.raises(asyncio.CancelledError):
        await writer
    await asyncio.sleep(status_writer.STATUS_COALESCE_SECONDS * 2)
    assert patched == []
    rt.forget(key)  # forgetting twice is harmless


def test_peering_flag_makes_kopf_peering_mandatory_with_distinct_priorities():
    """--peering passes a peering name (kopf: peering mandatory; without a name kopf only
    auto-detects and runs standalone when the object is missing) and a per-process priority
    (kopf pauses every operator that sees an equal one)."""
    from mlx_fleet_operator.main import build_parser, kopf_run_kwargs

    def kw(*argv: str) -> dict:
        return kopf_run_kwargs(build_parser().parse_args(list(argv)))

    standalone = kw()
    assert standalone.pop("identity")  # always ours, never kopf's getpass-based one (image uid)
    assert standalone == {"standalone": True, "clusterwide": True, "namespaces": []}
    peered = kw("--peering", "--namespace", "team-a")
    assert peered["standalone"] is False and peered["peering_name"] == "mlx-fleet"
    assert (peered["clusterwide"], peered["namespaces"]) == (False, ["team-a"])
    assert len({kw("--peering")["priority"] for _ in range(5)}) > 1  # random per process
    named = kw("--peering", "--peering-name", "fleet-a", "--peering-priority", "7")
    assert (named["peering_name"], named["priority"]) == ("fleet-a", 7)


def test_unusable_etcd_endpoint_is_refused_by_the_parser(capsys):
    from mlx_fleet_operator.main import build_parser

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--etcd-endpoint", "unix:///run/etcd.sock"])
    assert exit_info.value.code == 2
    assert "--etcd-endpoint" in capsys.readouterr().err


def test_https_etcd_endpoint_without_a_ca_is_a_preflight_error():
    from mlx_fleet_operator.main import PreflightError, build_parser, load_etcd_credentials

    with pytest.raises(PreflightError, match="is https: --etcd-ca-file is required"):
        load_etcd_credentials(build_parser().parse_args(["--etcd-endpoint", "https://etcd:2379"]))
