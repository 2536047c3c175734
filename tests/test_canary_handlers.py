"""The Canary handlers' tick (observe → decide → apply) on the in-memory store.

``canary_handlers.tick(rt, body, now=...)`` reads the operator's in-memory views, which the
tests fill directly (the target's record ``rt.deployment(T)``: spec synced, placed, status last
computed; ``rt.reports``, ``rt.stats``), and applies its decision to ``rt.candidates``, to the
TrafficSplit in the store (a :class:`~mlx_fleet.memstore.MemoryStore`, which passes etcd's
contract suite; a key root per test) and to the Kubernetes API. The API server is the one thing
stood in for: ``rt.custom_api`` records the status and spec patches (tick's only Kubernetes
calls), and ``kopf.event`` — which needs kopf's per-operator context (outside a handler it
raises ``LookupError``) — is replaced by a recorder. Time is the ``now`` passed to each tick.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import time
import uuid
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml

from mlx_fleet.source_policy import DEV_POLICY, SourcePolicy  # specs name local directories
from mlx_fleet.contract import (LATENCY_BOUNDS_SECONDS, TOKENS_PER_SECOND_BOUNDS,
                                AssignmentReport, AssignmentState, Histogram, Keys, LocalGuard,
                                RevisionStats, Role, StatsReport, TrafficSplit)
from mlx_fleet.memstore import MemoryStore
from mlx_fleet_operator import canary_handlers
from mlx_fleet_operator.canary_handlers import seed_candidates, tick
from mlx_fleet_operator.kube import GROUP, VERSION
from mlx_fleet_operator.runtime import Runtime
from mlx_fleet_operator.records import CandidateIntent, SyncedSpec
from mlx_fleet_operator.spec import parse_spec, to_assignment

REPO = Path(__file__).resolve().parents[1]
NS, TARGET = "team-a", "llm"
T = (NS, TARGET)
STABLE_NODE, CANDIDATE_NODE = "mac-a", "mac-b"
GiB = 1024**3
T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z
MD_SPEC = {"model": {"source": "file:///models/llm", "revision": "v1"}, "replicas": 1,
           "resources": {"memory": "1Gi"}}
CANARY_SPEC = {
    "targetRef": {"name": TARGET},
    "candidate": {"revision": "v2"},
    "steps": [{"setWeight": 10}, {"setWeight": 50}],
    "analysis": {"interval": "1m", "minRequests": 20,
                 "localGuard": {"window": "3s", "minFailures": 2, "failureRatio": 0.25}},
}


def unix(stamp: str) -> float:
    """An RFC 3339 status time → unix seconds (the instant, whatever the formatting)."""
    assert isinstance(stamp, str) and stamp.endswith("Z"), stamp
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


@pytest.fixture
def store(memory_store: MemoryStore) -> MemoryStore:
    """The store of every test here: the in-memory one (nothing here is about etcd itself)."""
    return memory_store


# --- the stand-ins for the API server ---------------------------------------------------------

class RecordingApi:
    """``CustomObjectsApi`` as far as tick uses it: merge patches of status and of spec."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str, str, dict, str | None]] = []

    def patch_namespaced_custom_object_status(self, group, version, namespace, plural, name,
                                              body, _content_type=None, **_):
        assert (group, version) == (GROUP, VERSION)
        self.calls.append(("status", plural, namespace, name, body, _content_type))

    def patch_namespaced_custom_object(self, group, version, namespace, plural, name, body,
                                       _content_type=None, **_):
        assert (group, version) == (GROUP, VERSION)
        self.calls.append(("spec", plural, namespace, name, body, _content_type))

    def statuses(self, name: str) -> list[dict]:
        """The Canary ``name``'s status patches, in order."""
        out = []
        for kind, plural, ns, n, body, ctype in self.calls:
            if (kind, plural, ns, n) == ("status", "canaries", NS, name):
                assert ctype == "application/merge-patch+json"
                out.append(body["status"])
        return out

    def spec_patches(self) -> list[tuple[str, str, str, dict, str | None]]:
        return [(plural, ns, n, body, ctype) for kind, plural, ns, n, body, ctype in self.calls
                if kind == "spec"]


@pytest.fixture
def events(monkeypatch) -> list[tuple[str, str, str, str]]:
    """kopf.event, recorded as (object name, type, reason, message)."""
    posted: list[tuple[str, str, str, str]] = []

    def event(body, *, type, reason, message=""):
        posted.append((body["metadata"]["name"], type, reason, message))

    monkeypatch.setattr(kopf, "event", event)
    return posted


def runtime(store, keys: Keys) -> Runtime:
    """A fresh operator Runtime: its per-Canary memory (last status patched, last analysis
    window) starts empty, as in a freshly started operator."""
    rt = Runtime(store=store, keys=keys, writer="test", source_policy=DEV_POLICY)
    rt.custom_api = RecordingApi()
    return rt


# --- the operator's views, filled directly ----------------------------------------------------

def set_target(rt: Runtime, revision: str = "v1", generation: int = 1) -> None:
    """The ModelDeployment as its last sync saw it (spec at ``revision``)."""
    spec = {**MD_SPEC, "model": {**MD_SPEC["model"], "revision": revision}}
    rt.deployment(T).observe_spec(SyncedSpec(parse_spec(spec), generation, "md-uid"))


def place(rt: Runtime, node: str, revision: str, role: Role,
          state: AssignmentState | None = AssignmentState.READY, generation: int = 1) -> None:
    """An assignment of ``revision`` on ``node`` (as reconciled), and the agent's report of it
    in ``state`` (None: not reported yet)."""
    spec = rt.synced(T).spec
    rt.deployment(T).placed[(node, revision)] = to_assignment(
        spec, namespace=NS, name=TARGET, uid="md-uid", generation=generation, role=role,
        revision=revision)
    if state is not None:
        rt.reports.setdefault(T, {})[(node, revision)] = AssignmentReport(
            node=node, namespace=NS, name=TARGET, generation=generation, revision=revision,
            state=state, reason="ModelLoaded" if state == AssignmentState.READY else "",
            endpoint=f"http://{node}.local:8000")


def healthy_target(rt: Runtime) -> None:
    """llm at v1, Ready on mac-a."""
    set_target(rt)
    place(rt, STABLE_NODE, "v1", Role.STABLE)


def hist(bounds: tuple[float, ...], value: float, n: int) -> Histogram:
    counts = [0] * (len(bounds) + 1)
    counts[bounds.index(value)] = n
    return Histogram(bounds=bounds, counts=counts, total=value * n)


def revision_stats(revision: str, requests: int, memory: int = GiB) -> RevisionStats:
    """Cumulative counters: every request took 0.2 s, first token after 0.05 s, 50 tok/s."""
    return RevisionStats(
        revision=revision, started_unix=T0 - 100, requests=requests,
        latency_seconds=hist(LATENCY_BOUNDS_SECONDS, 0.2, requests),
        ttft_seconds=hist(LATENCY_BOUNDS_SECONDS, 0.05, requests),
        tokens_per_second=hist(TOKENS_PER_SECOND_BOUNDS, 50, requests), memory_bytes=memory)


def set_stats(rt: Runtime, uid: str, at: float, stable: int, candidate: int,
              **report: Any) -> StatsReport:
    """mac-a's statistics for the canary ``uid``: cumulative request counts per revision."""
    r = StatsReport(node=STABLE_NODE, namespace=NS, name=TARGET, canary_uid=uid,
                    revisions={"v1": revision_stats("v1", stable),
                               "v2": revision_stats("v2", candidate)},
                    updated_unix=at, **report)
    rt.stats.setdefault(T, {})[STABLE_NODE] = r
    return r


def canary(name: str = "llm-v2", *, uid: str | None = None, spec: dict | None = None,
           annotations: dict[str, str] | None = None, status: dict | None = None) -> dict:
    body: dict[str, Any] = {
        "apiVersion": "mlx-fleet.io/v1alpha1", "kind": "Canary",
        "metadata": {"namespace": NS, "name": name, "uid": uid or uuid.uuid4().hex,
                     "generation": 1, "annotations": dict(annotations or {})},
        "spec": spec or CANARY_SPEC,
    }
    if status is not None:
        body["status"] = status
    return body


async def stored_split(rt: Runtime) -> TrafficSplit | None:
    kv = await rt.store.get(rt.keys.traffic(NS, TARGET))
    return None if kv is None else TrafficSplit.from_json(kv.value)


def conditions(status: dict) -> dict[str, tuple[str, str, str]]:
    return {c["type"]: (c["status"], c["reason"], c["message"]) for c in status["conditions"]}


def crd_status_properties() -> dict[str, dict]:
    [crd] = [d for d in yaml.safe_load_all(
        (REPO / "crds" / "mlx-fleet.io_canaries.yaml").read_text()) if d]
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"][
        "properties"]


def as_stored(status: dict) -> dict:
    """A status patch as the API server keeps it: fields the CRD does not know are pruned,
    nulls removed (merge patch)."""
    known = crd_status_properties()
    return {k: v for k, v in status.items() if k in known and v is not None}


def assert_fits_the_crd(status: dict) -> None:
    """Every field the CRD knows has the CRD's type (the API server rejects the whole patch
    otherwise)."""
    pytypes = {"string": str, "integer": int, "object": dict, "array": list}
    for key, prop in crd_status_properties().items():
        if status.get(key) is not None:
            assert isinstance(status[key], pytypes[prop["type"]]), (key, status[key])
            assert not isinstance(status[key], bool), (key, status[key])


# --- tests ------------------------------------------------------------------------------------

async def test_a_canary_of_a_missing_target_fails(store, keys, events):
    rt = runtime(store, keys)
    body = canary()
    assert await tick(rt, body, now=T0) == canary_handlers.TICK_SECONDS
    [status] = rt.custom_api.statuses("llm-v2")
    assert_fits_the_crd(status)
    assert (status["phase"], status["message"], status["currentWeight"],
            status["candidateRevision"]) == ("Failed", "target ModelDeployment llm not found",
                                             0, "v2")
    assert conditions(status) == {
        "Progressing": ("False", "TargetNotFound", "target ModelDeployment llm not found"),
        "Succeeded": ("False", "TargetNotFound", "target ModelDeployment llm not found"),
        "Degraded": ("True", "TargetNotFound", "target ModelDeployment llm not found")}
    assert events == [
        ("llm-v2", "Normal", "Started", "canary of v2 against stable ? started; waiting for the "
                                        "candidate"),
        ("llm-v2", "Warning", "TargetNotFound", "target ModelDeployment llm not found")]
    assert rt.candidates == {} and await stored_split(rt) is None
    assert rt.custom_api.spec_patches() == []

    # Terminal: the next tick changes nothing, even once the target exists.
    healthy_target(rt)
    await tick(rt, body, now=T0 + 1)
    assert len(rt.custom_api.statuses("llm-v2")) == 1 and len(events) == 2
    assert rt.candidates == {} and await stored_split(rt) is None


async def test_a_candidate_equal_to_the_targets_revision_fails_invalid_spec(store, keys, events):
    rt = runtime(store, keys)
    healthy_target(rt)
    spec = {**CANARY_SPEC, "candidate": {"revision": "v1"}}
    body = canary(spec=spec)
    await tick(rt, body, now=T0)
    message = "spec.candidate.revision: v1 is already the revision of ModelDeployment llm"
    [status] = rt.custom_api.statuses("llm-v2")
    assert_fits_the_crd(status)
    assert (status["phase"], status["message"], status["currentWeight"],
            status["candidateRevision"]) == ("Failed", message, 0, "v1")
    assert conditions(status) == {"Progressing": ("False", "InvalidSpec", message),
                                  "Succeeded": ("False", "InvalidSpec", message),
                                  "Degraded": ("True", "InvalidSpec", message)}
    assert events == [("llm-v2", "Warning", "InvalidSpec", message)]
    assert rt.candidates == {} and await stored_split(rt) is None

    # It stays Failed: no "promotion" of the revision the target already has.
    body["status"] = status
    for i in range(1, 3):
        await tick(rt, body, now=T0 + i)
    assert [s["phase"] for s in rt.custom_api.statuses("llm-v2")] == ["Failed"]
    assert len(events) == 1 and rt.custom_api.spec_patches() == []
    assert rt.candidates == {} and await stored_split(rt) is None


async def test_a_candidate_source_the_policy_refuses_fails_before_any_placement(
        store, keys, events):
    """Issue 19 (finding 2): ``spec.candidate.source`` is judged by the fleet's source policy
    (a loopback mirror under the secure default): the Canary fails ``SourceRefused`` naming
    the field, once, and no candidate is kept (no assignment, no split)."""
    rt = runtime(store, keys)
    rt.source_policy = SourcePolicy()  # the secure default
    healthy_target(rt)
    spec = {**CANARY_SPEC, "candidate": {"revision": "v2",
                                         "source": "https://127.0.0.1:8443/models/v2/"}}
    body = canary(spec=spec)
    await tick(rt, body, now=T0)
    [status] = rt.custom_api.statuses("llm-v2")
    assert_fits_the_crd(status)
    message = status["message"]
    assert message.startswith("spec.candidate.source: refused by the source policy: ")
    assert "allowPrivateNetworks" in message
    assert status["phase"] == "Failed" and status["currentWeight"] == 0
    assert conditions(status)["Degraded"] == ("True", "SourceRefused", message)
    assert events == [("llm-v2", "Warning", "SourceRefused", message)]
    assert rt.candidates == {} and await stored_split(rt) is None
    body["status"] = status
    await tick(rt, body, now=T0 + 1)
    assert len(events) == 1 and rt.candidates == {}


async def test_a_second_canary_on_a_busy_target_fails_and_never_takes_it_over(store, keys, events):
    rt = runtime(store, keys)
    healthy_target(rt)
    place(rt, CANDIDATE_NODE, "v2", Role.CANDIDATE)
    first = canary("llm-v2", uid="uid-first")
    await tick(rt, first, now=T0)
    owner = CandidateIntent("llm-v2", "v2")
    assert rt.candidates == {T: owner}
    split = await stored_split(rt)
    assert (split.canary, split.weight) == ("llm-v2", 10)

    second = canary("llm-v2-again", uid="uid-second")
    await tick(rt, second, now=T0 + 1)
    message = "spec.targetRef.name: ModelDeployment llm already has an active Canary llm-v2"
    [status] = rt.custom_api.statuses("llm-v2-again")
    assert_fits_the_crd(status)
    assert (status["phase"], status["message"], status["currentWeight"],
            status["candidateRevision"]) == ("Failed", message, 0, "v2")
    assert conditions(status)["Degraded"] == ("True", "TargetBusy", message)
    assert [e for e in events if e[0] == "llm-v2-again"] == [
        ("llm-v2-again", "Warning", "TargetBusy", message)]
    assert rt.candidates == {T: owner} and await stored_split(rt) == split

    # Later ticks of the failed one (its status now stored) leave the first canary alone.
    second["status"] = status
    for i in range(2, 4):
        await tick(rt, second, now=T0 + i)
    assert [s["phase"] for s in rt.custom_api.statuses("llm-v2-again")] == ["Failed"]
    assert len([e for e in events if e[0] == "llm-v2-again"]) == 1
    assert rt.candidates == {T: owner} and await stored_split(rt) == split
    await tick(rt, first, now=T0 + 4)
    assert rt.custom_api.statuses("llm-v2")[-1]["phase"] == "Progressing"

    # Its spec edited to another candidate while the target is still busy: TargetBusy again.
    second["spec"] = {**CANARY_SPEC, "candidate": {"revision": "v3"}}
    await tick(rt, second, now=T0 + 5)
    status = rt.custom_api.statuses("llm-v2-again")[-1]
    assert (status["phase"], status["candidateRevision"], status["message"]) == (
        "Failed", "v3", message)
    assert [e for e in events if e[0] == "llm-v2-again"][1:] == [
        ("llm-v2-again", "Warning", "TargetBusy", message)]
    assert rt.candidates == {T: owner} and await stored_split(rt) == split


async def test_pending_until_the_candidate_is_ready_then_the_first_step_split(store, keys, events):
    rt = runtime(store, keys)
    healthy_target(rt)
    uid = "uid-pending"
    body = canary(uid=uid)
    wake = rt.deployment(T).wake

    await tick(rt, body, now=T0)
    # The target's reconcile is told to keep the candidate resident, and woken to place it.
    assert rt.candidates == {T: CandidateIntent("llm-v2", "v2", None, None)} and wake.is_set()
    [pending] = rt.custom_api.statuses("llm-v2")
    assert_fits_the_crd(pending)
    message = "canary of v2 against stable v1 started; waiting for the candidate"
    stored = as_stored(pending)
    assert unix(stored.pop("stepStarted")) == T0
    assert stored.pop("started", "") == ""  # not started yet
    assert {k: v for k, v in stored.items() if k != "conditions"} == {
        "phase": "Pending", "observedGeneration": 1, "stableRevision": "v1",
        "candidateRevision": "v2", "currentStepIndex": 0, "currentWeight": 0,
        "failedWindows": 0, "message": message, "reason": "Started", "lastPromoteToken": "",
        "lastPromoteFullToken": "", "lastAbortToken": "", "memoryBaselineBytes": 0}
    assert conditions(pending) == {"Progressing": ("True", "Started", message),
                                   "Succeeded": ("False", "Started", message),
                                   "Degraded": ("False", "AsExpected", message)}
    assert events == [("llm-v2", "Normal", "Started", message)]
    # No candidate traffic yet: the split exists (agents start counting) at weight 0.
    split = await stored_split(rt)
    assert (split.weight, split.candidate_endpoints, split.canary_uid) == (0, [], uid)

    # Placed, still loading: Pending holds, nothing new is patched.
    place(rt, CANDIDATE_NODE, "v2", Role.CANDIDATE, AssignmentState.LOADING)
    await tick(rt, body, now=T0 + 5)
    assert len(rt.custom_api.statuses("llm-v2")) == 1
    assert (await stored_split(rt)).weight == 0

    # A report of an older generation of the assignment does not count as Ready.
    place(rt, CANDIDATE_NODE, "v2", Role.CANDIDATE, generation=2)
    rt.reports[T][(CANDIDATE_NODE, "v2")] = rt.reports[T][(CANDIDATE_NODE, "v2")].model_copy(
        update={"generation": 1})
    await tick(rt, body, now=T0 + 6)
    assert len(rt.custom_api.statuses("llm-v2")) == 1

    place(rt, CANDIDATE_NODE, "v2", Role.CANDIDATE)  # Ready
    set_stats(rt, uid, T0 + 9, stable=100, candidate=0)
    await tick(rt, body, now=T0 + 10)
    progressing = rt.custom_api.statuses("llm-v2")[-1]
    assert_fits_the_crd(progressing)
    assert (progressing["phase"], progressing["currentStepIndex"],
            progressing["currentWeight"]) == ("Progressing", 0, 10)
    assert progressing["message"] == "step 1/2: candidate weight 0% → 10%"
    assert conditions(progressing)["Progressing"] == ("True", "StepStarted",
                                                      progressing["message"])
    assert unix(progressing["started"]) == unix(progressing["stepStarted"]) == T0 + 10
    assert progressing["memoryBaselineBytes"] == GiB  # the memory-growth check's baseline
    assert events[-1] == ("llm-v2", "Normal", "StepStarted",
                          "step 1/2: candidate weight 0% → 10%")
    assert await stored_split(rt) == TrafficSplit(
        namespace=NS, name=TARGET, served_model_name=TARGET, stable_revision="v1",
        candidate_revision="v2", weight=10, canary="llm-v2", canary_uid=uid, generation=1,
        stats_interval_seconds=60.0, candidate_endpoints=["http://mac-b.local:8000"],
        guard=LocalGuard(enabled=True, window_seconds=3.0, min_failures=2, failure_ratio=0.25))
    assert rt.custom_api.spec_patches() == []

    # a candidate replica withdrawn for a drain (leaving its Mac) is forwarded to no more
    rt.deployment(T).withdrawn = {(CANDIDATE_NODE, "v2"): 0.0}
    await tick(rt, body, now=T0 + 11)
    assert (await stored_split(rt)).candidate_endpoints == []


async def progressing_canary(rt: Runtime, uid: str, **kw: Any) -> dict:
    """A canary of v2 against a healthy v1, at its first step (weight 10) since T0."""
    healthy_target(rt)
    place(rt, CANDIDATE_NODE, "v2", Role.CANDIDATE)
    set_stats(rt, uid, T0, stable=100, candidate=10)
    body = canary(uid=uid, **kw)
    await tick(rt, body, now=T0)
    assert rt.custom_api.statuses("llm-v2")[-1]["phase"] == "Progressing"
    assert (await stored_split(rt)).weight == 10
    return body


async def test_a_local_guard_trip_rolls_back(store, keys, events):
    rt = runtime(store, keys)
    uid = "uid-guard"
    body = await progressing_canary(rt, uid)
    wake = rt.deployment(T).wake
    wake.clear()

    # A trip reported under another canary's uid (an older split) is not this canary's.
    set_stats(rt, "uid-older", T0 + 2, stable=110, candidate=12, guard_tripped=True,
              guard_reason="stale")
    await tick(rt, body, now=T0 + 2)
    assert rt.custom_api.statuses("llm-v2")[-1]["phase"] == "Progressing"
    assert rt.candidates == {T: CandidateIntent("llm-v2", "v2")}

    reason = "3 of 4 candidate requests failed in the last 3s (minFailures 2, failureRatio 0.25)"
    set_stats(rt, uid, T0 + 3, stable=110, candidate=14, guard_tripped=True, guard_reason=reason)
    await tick(rt, body, now=T0 + 3)
    status = rt.custom_api.statuses("llm-v2")[-1]
    assert_fits_the_crd(status)
    message = f"rolled back to v1: local guard tripped: node mac-a: {reason}"
    assert (status["phase"], status["message"], status["currentWeight"]) == (
        "RolledBack", message, 0)
    assert conditions(status) == {"Progressing": ("False", "RolledBack", message),
                                  "Succeeded": ("False", "RolledBack", message),
                                  "Degraded": ("True", "RolledBack", message)}
    assert events[-1] == ("llm-v2", "Warning", "RolledBack", message)
    # All traffic back to stable, the candidate to be unloaded by the target's reconcile.
    assert await stored_split(rt) is None
    assert rt.candidates == {} and wake.is_set()
    assert rt.custom_api.spec_patches() == []


async def test_the_candidate_is_released_only_once_its_split_is_gone(store, keys, events,
                                                                   monkeypatch):
    """A rolled-back candidate keeps its assignment until the traffic split that sends it
    requests is deleted (agents that still see the split would route to an unloaded revision
    and answer 404). While etcd refuses the delete — or a concurrent write wins its compare —
    nothing of the end is applied: the candidate stays kept, no status, no event (an operator
    restarted then still seeds the candidate from the running status). The tick that deletes
    the split applies it all and releases the candidate; the target's sync unloads it after
    the endpoint grace (tests/test_operator_runtime.py)."""
    from mlx_fleet.store import StoreError

    rt = runtime(store, keys)
    uid = "uid-order"
    body = await progressing_canary(rt, uid)
    set_stats(rt, uid, T0 + 1, stable=110, candidate=14, guard_tripped=True,
              guard_reason="3 of 4 candidate requests failed")
    real_txn = store.txn
    patches, posted = len(rt.custom_api.calls), len(events)

    async def refused(*args, **kwargs):
        raise StoreError("etcd unavailable")

    async def lost_the_compare(*args, **kwargs):
        return 0

    for failing in (refused, lost_the_compare):
        monkeypatch.setattr(store, "txn", failing)
        await tick(rt, body, now=T0 + 1)
        assert (await stored_split(rt)).weight == 10  # not deleted ...
        assert rt.candidates == {T: CandidateIntent("llm-v2", "v2")}  # ... so still kept
        assert rt.deployment(T).released_candidate is None
        assert (len(rt.custom_api.calls), len(events)) == (patches, posted)

    monkeypatch.setattr(store, "txn", real_txn)
    await tick(rt, body, now=T0 + 2)
    assert await stored_split(rt) is None
    assert rt.custom_api.statuses("llm-v2")[-1]["phase"] == "RolledBack"
    assert events[-1][2] == "RolledBack"
    assert rt.candidates == {}
    released = rt.deployment(T).released_candidate
    assert released is not None and released.intent == CandidateIntent("llm-v2", "v2")


async def test_a_new_canary_waits_for_the_last_candidate_to_unload(store, keys, events):
    """Placement keeps one candidate per target: a Canary that starts while the candidate of
    an ended one is still in its endpoint grace would unload that candidate at once (the
    404s the grace exists to prevent). It waits — no split, no status — and starts after."""
    rt = runtime(store, keys)
    body = await progressing_canary(rt, "uid-first")
    assert rt.custom_api.statuses("llm-v2")[-1]["phase"] == "Progressing"
    await canary_handlers.canary_deleted(body=body, namespace=NS, name="llm-v2",
                                         memo=kopf.Memo(runtime=rt))
    assert rt.deployment(T).released_candidate is not None

    calls = len(rt.custom_api.calls)
    v3 = canary("llm-v3", uid="uid-next", spec={**CANARY_SPEC, "candidate": {"revision": "v3"}})
    wait = await tick(rt, v3, now=T0 + 1)
    assert 0 < wait <= canary_handlers.ENDPOINT_GRACE_SECONDS + 0.05
    assert rt.candidates == {} and await stored_split(rt) is None
    assert len(rt.custom_api.calls) == calls  # nothing patched yet

    rec = rt.deployment(T)
    rec.released_candidate = dataclasses.replace(rec.released_candidate, at=(
        time.monotonic() - canary_handlers.ENDPOINT_GRACE_SECONDS))  # the grace is over
    await tick(rt, v3, now=T0 + 2)
    assert rt.candidates == {T: CandidateIntent("llm-v3", "v3")}
    assert rec.released_candidate is None


async def test_deleting_a_canary_whose_split_changed_meanwhile_is_retried(store, keys, events,
                                                                          monkeypatch):
    rt = runtime(store, keys)
    body = await progressing_canary(rt, "uid-race")

    async def lost_the_compare(*args, **kwargs):
        return 0

    monkeypatch.setattr(store, "txn", lost_the_compare)
    with pytest.raises(kopf.TemporaryError):
        await canary_handlers.canary_deleted(body=body, namespace=NS, name="llm-v2",
                                             memo=kopf.Memo(runtime=rt))
    assert T in rt.candidates and rt.deployment(T).released_candidate is None


async def test_a_rogue_nodes_stats_neither_trip_the_guard_nor_enter_the_analysis(store, keys,
                                                                               events):
    """Issue 19 review: an agent credential may write stats/<its node>/ for any deployment,
    with this canary's uid. A node that holds no slot of the target is not listened to: no
    roll-back on its "guard trip", and its counts are not in the analysis window."""
    rt = runtime(store, keys)
    uid = "uid-rogue"
    body = await progressing_canary(rt, uid)
    rogue = StatsReport(node="rogue", namespace=NS, name=TARGET, canary_uid=uid,
                        revisions={"v1": revision_stats("v1", 10_000),
                                   "v2": revision_stats("v2", 10_000)},
                        updated_unix=T0 + 61, guard_tripped=True, guard_reason="forged")
    rt.stats[T]["rogue"] = rogue
    await tick(rt, body, now=T0 + 61)  # an interval on: a new analysis window is taken
    status = rt.custom_api.statuses("llm-v2")[-1]
    assert status["phase"] == "Progressing", status
    assert rt.candidates == {T: CandidateIntent("llm-v2", "v2")}
    window = rt.canary(uid).window
    assert window.at == T0 + 61 and set(window.reports) == {STABLE_NODE}
    # the same report from a node that holds a slot of the target is believed
    place(rt, "rogue", "v1", Role.STABLE)
    await tick(rt, body, now=T0 + 62)
    assert rt.custom_api.statuses("llm-v2")[-1]["phase"] == "RolledBack"


async def test_passing_windows_step_up_then_promote_then_succeed(store, keys, events):
    rt = runtime(store, keys)
    uid = "uid-steps"
    body = await progressing_canary(rt, uid)  # step 1 (10%) since T0

    async def window(at: float, stable: int, candidate: int) -> dict:
        set_stats(rt, uid, at - 1, stable=stable, candidate=candidate)
        await tick(rt, body, now=at)
        return rt.custom_api.statuses("llm-v2")[-1]

    patches = len(rt.custom_api.statuses("llm-v2"))
    await window(T0 + 1, 100, 10)  # the first window starts here; nothing to judge yet
    await window(T0 + 30, 200, 30)  # less than an interval later: no analysis
    assert len(rt.custom_api.statuses("llm-v2")) == patches

    # One interval on, but only 5 candidate requests in it: Inconclusive, the weight holds.
    status = await window(T0 + 61, 400, 15)
    assert (status["phase"], status["currentStepIndex"], status["currentWeight"]) == (
        "Progressing", 0, 10)
    assert status["lastAnalysis"]["verdict"] == "Inconclusive"
    assert (status["lastAnalysis"]["stableRequests"],
            status["lastAnalysis"]["candidateRequests"]) == (300, 5)
    assert (await stored_split(rt)).weight == 10

    # Next window: 60 candidate and 240 stable requests, same latency, TTFT, tokens/s, memory.
    status = await window(T0 + 121, 640, 75)
    assert_fits_the_crd(status)
    assert (status["phase"], status["currentStepIndex"], status["currentWeight"]) == (
        "Progressing", 1, 50)
    assert status["lastAnalysis"]["verdict"] == "Pass"
    assert status["lastAnalysis"]["message"] == "all 5 judged checks passed"
    assert (status["lastAnalysis"]["stableRequests"],
            status["lastAnalysis"]["candidateRequests"]) == (240, 60)
    # Memory growth needs ten minutes of canary age; until then it does not hold the window.
    assert [(c["name"], c["verdict"]) for c in status["lastAnalysis"]["checks"]] == [
        ("errorRate", "Pass"), ("latencyP95", "Pass"), ("ttftP95", "Pass"),
        ("tokensPerSecond", "Pass"), ("memoryGrowth", "Inconclusive"), ("crashRate", "Pass")]
    assert (unix(status["stepStarted"]), unix(status["started"])) == (T0 + 121, T0)
    assert events[-1] == ("llm-v2", "Normal", "StepStarted",
                          "step 2/2: candidate weight 10% → 50%")
    assert (await stored_split(rt)).weight == 50
    assert rt.custom_api.spec_patches() == []

    # The last step's window passes: the target's spec.model.revision is patched (promotion).
    status = await window(T0 + 181, 880, 315)
    assert_fits_the_crd(status)
    assert (status["phase"], status["currentWeight"], status["message"]) == (
        "Promoting", 100, "all 2 steps passed; promoting v2")
    assert conditions(status)["Progressing"] == ("True", "Promoting", status["message"])
    assert events[-1] == ("llm-v2", "Normal", "Promoting", status["message"])
    assert rt.custom_api.spec_patches() == [
        ("modeldeployments", NS, TARGET, {"spec": {"model": {"revision": "v2"}}},
         "application/merge-patch+json")]
    assert (await stored_split(rt)).weight == 100
    assert rt.candidates == {T: CandidateIntent("llm-v2", "v2")}

    # The target's sync has seen the new revision, but it is not rolled out yet: Promoting.
    set_target(rt, revision="v2", generation=2)
    rt.deployment(T).placed = {}
    place(rt, STABLE_NODE, "v1", Role.PREVIOUS)
    place(rt, CANDIDATE_NODE, "v2", Role.STABLE)
    rt.deployment(T).status.last = {"updatedReplicas": 1, "conditions": [
        {"type": "Progressing", "status": "True", "reason": "RollingUpdate"}]}
    await tick(rt, body, now=T0 + 182)
    assert rt.custom_api.statuses("llm-v2")[-1]["phase"] == "Promoting"
    assert len(rt.custom_api.spec_patches()) == 1  # promoted once

    # Rolled out (Complete at v2): Succeeded; the split goes, nothing is kept for the canary.
    del rt.deployment(T).placed[(STABLE_NODE, "v1")]
    rt.deployment(T).status.last = {"updatedReplicas": 1, "conditions": [
        {"type": "Progressing", "status": "False", "reason": "Complete"}]}
    await tick(rt, body, now=T0 + 183)
    status = rt.custom_api.statuses("llm-v2")[-1]
    assert_fits_the_crd(status)
    message = "v2 is the ModelDeployment's revision and Ready"
    assert (status["phase"], status["message"], status["currentWeight"]) == (
        "Succeeded", message, 100)
    assert conditions(status) == {"Progressing": ("False", "Succeeded", message),
                                  "Succeeded": ("True", "Succeeded", message),
                                  "Degraded": ("False", "AsExpected", message)}
    assert events[-1] == ("llm-v2", "Normal", "Succeeded", message)
    assert rt.candidates == {} and await stored_split(rt) is None
    assert len(rt.custom_api.spec_patches()) == 1


async def test_the_abort_annotation_aborts(store, keys, events):
    rt = runtime(store, keys)
    body = await progressing_canary(rt, "uid-abort")
    await tick(rt, body, now=T0 + 1)
    assert rt.custom_api.statuses("llm-v2")[-1]["phase"] == "Progressing"

    body["metadata"]["annotations"][canary_handlers.ANNOTATION_ABORT] = "1767225602"
    await tick(rt, body, now=T0 + 2)
    status = rt.custom_api.statuses("llm-v2")[-1]
    assert_fits_the_crd(status)
    message = "aborted by annotation; all traffic to stable v1"
    assert (status["phase"], status["message"], status["currentWeight"],
            status["lastAbortToken"]) == ("Aborted", message, 0, "1767225602")
    assert conditions(status) == {"Progressing": ("False", "Aborted", message),
                                  "Succeeded": ("False", "Aborted", message),
                                  "Degraded": ("False", "AsExpected", message)}
    assert events[-1] == ("llm-v2", "Warning", "Aborted", message)
    assert rt.candidates == {} and await stored_split(rt) is None
    assert rt.custom_api.spec_patches() == []


async def test_restart_mid_canary_keeps_the_candidate_and_the_step(store, keys, events,
                                                                   monkeypatch):
    rt = runtime(store, keys)
    uid = "uid-restart"
    # A promote-full annotation left from before the canary started: never acted on.
    body = await progressing_canary(
        rt, uid, annotations={canary_handlers.ANNOTATION_PROMOTE_FULL: "f0"})
    body["metadata"]["annotations"][canary_handlers.ANNOTATION_PROMOTE] = "p1"  # next step
    await tick(rt, body, now=T0 + 5)
    running = rt.custom_api.statuses("llm-v2")[-1]
    assert (running["phase"], running["currentStepIndex"], running["currentWeight"]) == (
        "Progressing", 1, 50)
    split = await stored_split(rt)
    assert split.weight == 50

    # What the API server lists after the operator restarts: the stored (pruned) statuses.
    def item(name: str, status: dict | None, spec: dict = CANARY_SPEC) -> dict:
        obj = canary(name, spec=spec, status=None if status is None else as_stored(status))
        obj["metadata"]["namespace"] = NS
        return obj

    other = {**CANARY_SPEC, "targetRef": {"name": "other"}}
    listing = {"items": [
        item("llm-v2", running),
        item("other-v2", {**running, "phase": "RolledBack"}, other),  # ended: nothing to keep
        item("other-v3", None, {**other, "candidate": {"revision": "v3"}}),  # never started
    ]}

    class Api(RecordingApi):
        def list_cluster_custom_object(self, group, version, plural, **_):
            assert (group, version, plural) == (GROUP, VERSION, "canaries")
            return listing

    seeded = seed_candidates(Api())
    assert seeded == {T: CandidateIntent("llm-v2", "v2", None, None)}

    # An operator watching named namespaces lists each of them (its Roles grant no more: the
    # chart's RBAC per namespace); one with a pattern lists cluster-wide and filters later.
    class NamespacedApi(RecordingApi):
        listed: list[str] = []

        def list_namespaced_custom_object(self, group, version, namespace, plural, **_):
            assert (group, version, plural) == (GROUP, VERSION, "canaries")
            self.listed.append(namespace)
            return listing if namespace == NS else {"items": []}

    namespaced = NamespacedApi()
    assert seed_candidates(namespaced, (NS, "elsewhere")) == seeded
    assert namespaced.listed == [NS, "elsewhere"]
    assert seed_candidates(Api(), ("team-*",)) == seeded

    # The restarted operator: the same store and fleet, a fresh process memory.
    rt2 = runtime(store, keys)
    rt2.seed_candidates(seeded)
    rt2.deployment(T).observe_spec(rt.synced(T))  # its target resumed ...
    rt2.deployment(T).placed = dict(rt.deployment(T).placed)  # ... and reconciled
    for view in ("reports", "stats"):
        setattr(rt2.views, view, getattr(rt.views, view))
    restarted = {**body, "status": listing["items"][0]["status"]}
    events.clear()
    await tick(rt2, restarted, now=T0 + 6)
    # Same step, same weight, same split; nothing to correct in the status, no promotion.
    assert events == [] and rt2.custom_api.calls == []
    assert rt2.candidates == {T: CandidateIntent("llm-v2", "v2", None, None)}
    assert await stored_split(rt2) == split


async def test_deleting_a_running_canary_returns_all_traffic_to_stable(store, keys, events,
                                                                      monkeypatch):
    rt = runtime(store, keys)
    body = await progressing_canary(rt, "uid-delete")
    await tick(rt, body, now=T0 + 1)
    assert (await stored_split(rt)).weight == 10 and T in rt.candidates
    await canary_handlers.canary_deleted(body=body, namespace=NS, name="llm-v2",
                                         memo=kopf.Memo(runtime=rt))
    assert await stored_split(rt) is None  # agents route everything to stable
    assert T not in rt.candidates           # the target's reconcile unloads the candidate
    assert rt.deployment(T).wake.is_set()


async def test_deleting_a_canary_never_touches_another_canarys_target(store, keys, events,
                                                                      monkeypatch):
    rt = runtime(store, keys)
    body = await progressing_canary(rt, "uid-keep")
    await tick(rt, body, now=T0 + 1)
    other = canary("llm-v3", spec={**CANARY_SPEC, "candidate": {"revision": "v3"}})
    await canary_handlers.canary_deleted(body=other, namespace=NS, name="llm-v3",
                                         memo=kopf.Memo(runtime=rt))
    assert (await stored_split(rt)).candidate_revision == "v2"
    assert rt.candidates[T].canary == "llm-v2"


async def test_at_full_weight_the_candidate_is_judged_against_the_last_stable_window(
        store, keys, events):
    """At 100 % the stable revision gets no requests: a window is judged against the last
    stable window that had enough of them, so the last step can pass (and fail) at all."""
    rt = runtime(store, keys)
    uid = "uid-full"
    spec = {**CANARY_SPEC, "steps": [{"setWeight": 10}, {"setWeight": 100}]}
    body = await progressing_canary(rt, uid, spec=spec)

    async def window(at: float, stable: int, candidate: int) -> dict:
        set_stats(rt, uid, at - 1, stable=stable, candidate=candidate)
        await tick(rt, body, now=at)
        return rt.custom_api.statuses("llm-v2")[-1]

    await window(T0 + 1, 100, 100)
    status = await window(T0 + 61, 200, 200)       # 100 stable, 100 candidate: Pass → 100 %
    assert (status["currentWeight"], status["lastAnalysis"]["verdict"]) == (100, "Pass")
    status = await window(T0 + 121, 200, 300)      # no stable request at all in this window
    assert status["lastAnalysis"]["verdict"] == "Pass"
    assert status["lastAnalysis"]["stableRequests"] == 100  # the baseline window's
    assert status["phase"] == "Promoting"
