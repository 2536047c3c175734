"""The operator's Runtime and handlers without a cluster: the daemon re-armed after conflicts,
supervised followers and the liveness probe, orphan collection, closing, invalid specs, the
status writer, forgetting a deployment, and the command line. The store, where one is needed,
is the in-memory one (:class:`~mlx_fleet.memstore.MemoryStore`, which passes etcd's contract
suite); the operator against the real etcd and API server: tests/test_operator_kopf.py."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest

from fleet_helpers import asg_key, node_record, stored_assignment
from mlx_fleet.source_policy import DEV_POLICY  # the specs name local directories
from mlx_fleet.contract import (Assignment, AssignmentReport, AssignmentState, Keys,
                                ModelSource)
from mlx_fleet.memstore import MemoryStore

TIMEOUT = 60.0


@pytest.fixture
def store(memory_store: MemoryStore) -> MemoryStore:
    """The store of every test here: the in-memory one (nothing here is about etcd itself)."""
    return memory_store


async def test_conflict_rearms_the_daemon(monkeypatch):
    """A reconcile that gives up on etcd conflicts wakes its daemon again soon (not only at the
    30 s resync)."""
    import kopf

    from mlx_fleet_operator import sync
    from mlx_fleet_operator.reconcile import ConflictError
    from mlx_fleet_operator.runtime import Runtime

    async def always_conflict(*args, **kwargs):
        raise ConflictError("ns/llm: lost", conflicts=8)

    rt = Runtime(store=None, keys=Keys("/t"), writer="test", source_policy=DEV_POLICY)
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


async def one_node_deployment(store, keys, monkeypatch, patched: list[dict]):
    """A Runtime on ``store`` with one Mac registered (mac-a, 64 GiB) and the body of a
    one-replica ModelDeployment ns/llm at v1 (1 GiB); its status patches go to ``patched``
    and kopf's events nowhere. Returns (runtime, key, body)."""
    import kopf

    from mlx_fleet_operator.runtime import Runtime

    async def patch_status(key, status):
        patched.append(dict(status))

    rt = Runtime(store=store, keys=keys, writer="test", patch_status=patch_status,
                 source_policy=DEV_POLICY)
    monkeypatch.setattr(kopf, "event", lambda body, **_: None)
    await store.put(keys.node("mac-a"), node_record("mac-a").to_json())
    body = {"metadata": {"namespace": "ns", "name": "llm", "generation": 1, "uid": "u"},
            "spec": {"model": {"source": "file:///m", "revision": "v1"}, "replicas": 1,
                     "resources": {"memory": "1Gi"}}}
    return rt, ("ns", "llm"), body


async def test_status_patches_coalesce_and_a_resync_of_nothing_writes_nothing(store, keys,
                                                                              monkeypatch):
    """Statuses computed in quick succession (replica placed, then Ready) become one patch of
    the latest; a re-sync with nothing changed writes nothing to etcd and patches nothing."""
    from mlx_fleet_operator import status_writer
    from mlx_fleet_operator.sync import sync

    monkeypatch.setattr(status_writer, "STATUS_COALESCE_SECONDS", 3600.0)  # flushed by hand
    patched: list[dict] = []

    rt, key, body = await one_node_deployment(store, keys, monkeypatch, patched)
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
    for k in (key, other):  # both claim the served name "llm": a served-name conflict
        a = Assignment(namespace=k[0], name=k[1], served_model_name="llm",
                       source=ModelSource(uri="/m", revision="v1"), memory_bytes=1)
        rt.deployment(k).reconciled({("mac-a", "v1"): a}, unsettled=True,
                                    drain=DrainState(moving=(("mac-a", "v1"),), blocked="full"))
    rt.queue_status(key, {"readyReplicas": 0})
    writer = rt.deployment(key).status.writer
    rt.deployment(other).wake.clear()
    rt.forget(key)
    assert rt.deployment(other).wake.is_set()  # its ServedNameConflict clears on its re-sync
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


async def test_a_forged_report_from_another_node_does_not_set_per_replica_memory(
        store, keys, monkeypatch):
    """Issue 19 review: a rogue agent credential writes reports/<its node>/ns/llm/v1 with a
    1 TiB estimate for a deployment never assigned to it. Only the node holding the slot is
    believed: the replica keeps its Mac and the honest 8 GiB."""
    import kopf

    from mlx_fleet_operator.runtime import Runtime
    from mlx_fleet_operator.sync import sync

    async def patch_status(key, status):
        pass

    rt = Runtime(store=store, keys=keys, writer="test", patch_status=patch_status,
                 source_policy=DEV_POLICY)
    monkeypatch.setattr(kopf, "event", lambda body, **_: None)
    await store.put(keys.node("mac-a"), node_record("mac-a").to_json())
    key = ("ns", "llm")
    body = {"metadata": {"namespace": "ns", "name": "llm", "generation": 1, "uid": "u"},
            "spec": {"model": {"source": "file:///m", "revision": "v1"}, "replicas": 1}}
    log = logging.getLogger("test")
    await sync(rt, body, log)  # no estimate yet: one replica placed to get one
    assert set(rt.deployment(key).placed) == {("mac-a", "v1")}

    def rep(node: str, estimate: int) -> AssignmentReport:
        return AssignmentReport(node=node, namespace="ns", name="llm", generation=1,
                                revision="v1", state=AssignmentState.READY,
                                endpoint=f"http://{node}.local:8000",
                                estimated_bytes=estimate)

    rt.reports[key] = {("mac-a", "v1"): rep("mac-a", 8 * 2**30),
                       ("rogue", "v1"): rep("rogue", 2**40)}
    await sync(rt, body, log)
    stored = Assignment.from_json((await store.get(asg_key(keys, "mac-a", "ns", "llm"))).value)
    assert stored.memory_bytes == 8 * 2**30
    assert set(rt.deployment(key).placed) == {("mac-a", "v1")}
    status = rt.deployment(key).status.pending or rt.deployment(key).status.last
    assert [n["name"] for n in status["nodes"]] == ["mac-a"]
    rt.forget(key)


@pytest.mark.parametrize("active, released_ago, held", [
    # the running Canary's candidate always stays
    ("v3", None, "v3"),
    ("v3", 0.5, "v3"),
    # one whose Canary ended stays for the grace after its split was removed, then goes
    (None, 0.0, "v2"),
    (None, 1.9, "v2"),
    (None, 2.0, None),
    (None, 30.0, None),
    # none kept, none released
    (None, None, None),
])
def test_a_released_candidate_stays_for_the_endpoint_grace(active, released_ago, held):
    from mlx_fleet_operator.records import CandidateIntent, DeploymentRecord, ReleasedCandidate

    now, grace = 1000.0, 2.0
    rec = DeploymentRecord()
    if released_ago is not None:
        rec.released_candidate = ReleasedCandidate(CandidateIntent("c", "v2"), now - released_ago)
    kept = CandidateIntent("c3", active) if active else None
    got = rec.resident_candidate(kept, now, grace)
    assert (got.revision if got else None) == held


async def test_an_ended_canarys_candidate_unloads_only_after_the_grace(store, keys, monkeypatch):
    """A Canary let go of its candidate (aborted, rolled back, deleted) once its traffic split
    was removed: the target's sync keeps the candidate's assignment for the endpoint grace —
    agents that have not yet seen the split go keep serving it — re-arms itself for the end of
    the grace, and only then deletes it. A new Canary's candidate replaces a released one."""
    import time

    from mlx_fleet_operator.records import CandidateIntent
    from mlx_fleet_operator.sync import ENDPOINT_GRACE_SECONDS, sync

    rt, key, body = await one_node_deployment(store, keys, monkeypatch, [])
    rearmed: list[float] = []
    monkeypatch.setattr(rt, "rearm", lambda key, delay: rearmed.append(delay))
    log = logging.getLogger("test")

    async def revisions() -> set[str]:
        listed = await store.list(keys.assignments_prefix)
        return {Assignment.from_json(kv.value).source.revision for kv in listed.items}

    rt.keep_candidate(key, CandidateIntent("llm-v2", "v2"))
    await sync(rt, body, log)
    assert await revisions() == {"v1", "v2"}

    assert rt.release_candidate(key, "llm-v2")  # its split was just removed
    await sync(rt, body, log)
    assert await revisions() == {"v1", "v2"}  # still served during the grace
    assert rearmed and 0 < rearmed[-1] <= ENDPOINT_GRACE_SECONDS + 0.05

    rt.deployment(key).released_candidate = dataclasses.replace(
        rt.deployment(key).released_candidate, at=time.monotonic() - ENDPOINT_GRACE_SECONDS)
    rearmed.clear()
    await sync(rt, body, log)
    assert await revisions() == {"v1"}  # the grace is over: unloaded
    assert rearmed == []

    assert not rt.release_candidate(key, "llm-v2")  # released once only
    rt.keep_candidate(key, CandidateIntent("llm-v3", "v3"))
    assert rt.deployment(key).released_candidate is None
    rt.forget(key)
