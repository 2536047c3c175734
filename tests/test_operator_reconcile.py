"""reconcile: placement written to the store in one fenced transaction.

On the in-memory store (:class:`~mlx_fleet.memstore.MemoryStore`, which passes etcd's contract
suite); the tests of the fencing itself — a stale read losing, a competing write in the middle
of a read, a dozen reconciles racing — run on the real etcd too: tests/test_integration_operator.py
calls these same test functions with the real etcd's store."""

from __future__ import annotations

import asyncio

import pytest

from mlx_fleet.contract import (Assignment, AssignmentReport, AssignmentState, Keys, ModelSource,
                                NodeCapacity, NodeRecord, PlacementEpoch, Role)
from mlx_fleet.store import Put
from mlx_fleet.store_api import Store
from mlx_fleet_operator import reconcile as rc
from mlx_fleet_operator.placement import PlacementRequest
from mlx_fleet_operator.rollout import RevisionTarget

GiB = 1024**3


@pytest.fixture
def store(memory_store: Store) -> Store:
    """The in-memory store (the fencing tests run on the real etcd too, from
    tests/test_integration_operator.py)."""
    return memory_store


def node(name: str, mem_gib: int = 16) -> NodeRecord:
    return NodeRecord(name=name, address=f"http://{name}:8000",
                      capacity=NodeCapacity(memory_total_bytes=mem_gib * GiB,
                                            memory_available_bytes=mem_gib * GiB,
                                            chip="Apple M3 Max", chip_generation=3))


def request(name: str = "llm", replicas: int = 1, mem_gib: int = 2,
            rev: str = "v1") -> PlacementRequest:
    return PlacementRequest(namespace="ns", name=name, replicas=replicas,
                            memory_bytes=mem_gib * GiB, revision=rev)


def assignment(name: str = "llm", gen: int = 1, mem_gib: int = 2, rev: str = "v1",
               role: Role = Role.STABLE, uri: str = "/models/x") -> Assignment:
    return Assignment(namespace="ns", name=name, generation=gen, served_model_name=name,
                      source=ModelSource(uri=uri, revision=rev), memory_bytes=mem_gib * GiB,
                      role=role)


def intent(name: str = "llm", replicas: int = 1, mem_gib: int = 2, gen: int = 1,
           rev: str = "v1", uri: str = "/models/x", candidate: str | None = None,
           surge: int = 1, unavailable: int = 1) -> rc.Intent:
    """The operator's intent for one deployment: stable ``rev`` (+ a candidate revision)."""
    stable = RevisionTarget(request(name, replicas, mem_gib, rev),
                            assignment(name, gen, mem_gib, rev, uri=uri))
    cand = None if candidate is None else RevisionTarget(
        request(name, 1, mem_gib, candidate),
        assignment(name, gen, mem_gib, candidate, Role.CANDIDATE))
    return rc.Intent(stable=stable, candidate=cand, max_surge=surge, max_unavailable=unavailable)


async def put_nodes(store, keys: Keys, *nodes: NodeRecord) -> None:
    for n in nodes:
        await store.put(keys.node(n.name), n.to_json())


async def stored(store, keys: Keys) -> dict[tuple[str, str], Assignment]:
    """(node, revision) → stored assignment (every deployment)."""
    listing = await store.list(keys.assignments_prefix)
    out = {}
    for kv in listing.items:
        node_, _, _, rev = keys.parse_assignment(kv.key)
        a = Assignment.from_json(kv.value)
        assert a.revision == rev  # the key's last segment is the record's revision
        out[(node_, rev)] = a
    return out


async def roles(store, keys: Keys, name: str = "llm") -> set[tuple[str, str, Role]]:
    return {(n, r, a.role) for (n, r), a in (await stored(store, keys)).items() if a.name == name}


def ready(*slots: tuple[str, str], gen: int, name: str = "llm",
          state: AssignmentState = AssignmentState.READY) -> dict[tuple[str, str], AssignmentReport]:
    return {(n, r): AssignmentReport(node=n, namespace="ns", name=name, revision=r,
                                     generation=gen, state=state, endpoint=f"http://{n}:8000")
            for n, r in slots}


async def revision(store) -> int:
    return (await store.list("/mlx-fleet-test/none/")).revision


async def test_placement_written_and_idempotent(store, keys):
    await put_nodes(store, keys, node("a", 16), node("b", 32))
    res = await rc.reconcile(store, keys, intent())
    assert res.written and res.decision.nodes == ("b",)  # Spread: most free
    assert await stored(store, keys) == {("b", "v1"): assignment()}
    epoch = PlacementEpoch.from_json((await store.get(keys.placement_epoch)).value)
    assert epoch.counter == 1

    before = await revision(store)
    again = await rc.reconcile(store, keys, intent())
    assert not again.written and again.decision.nodes == ("b",)
    assert again.assignments == {("b", "v1"): assignment()}
    assert await revision(store) == before  # nothing written, not even a transaction

    # A new generation that changes nothing for the node leaves the stored record untouched.
    res3 = await rc.reconcile(store, keys, intent(gen=2))
    assert not res3.written and res3.assignments == {("b", "v1"): assignment()}
    assert await revision(store) == before
    # A spec change the node must act on (same revision) rewrites the assignment in place.
    res4 = await rc.reconcile(store, keys, intent(gen=3, uri="/models/y"))
    assert res4.written and await stored(store, keys) == {
        ("b", "v1"): assignment(gen=3, uri="/models/y")}


async def test_stale_read_loses_and_retries(store, keys):
    await put_nodes(store, keys, node("a"), node("b"))
    view = await rc.read_fleet(store, keys)
    stale = rc.plan(keys, view, "ns", "llm", intent("llm"))
    # Another operator replica places a different deployment in between.
    other = await rc.reconcile(store, keys, intent("other"))
    assert other.written
    assert not await rc.apply_plan(store, keys, stale)  # the stale transaction fails its compares
    # nothing clobbered
    assert {n for n, _ in await stored(store, keys)} == set(other.decision.nodes)

    # The retry loop re-reads and succeeds; the conflict is counted.
    real_read = rc.read_fleet
    calls = 0

    async def read_then_race(store_, keys_, memo=None, **views):
        nonlocal calls
        calls += 1
        v = await real_read(store_, keys_, memo, **views)
        if calls == 1:  # a concurrent writer bumps the epoch right after our first read
            await store.put(keys.placement_epoch, PlacementEpoch(counter=99, writer="x").to_json())
        return v

    rc_read = rc.read_fleet
    rc.read_fleet = read_then_race
    try:
        res = await rc.reconcile(store, keys, intent("llm"))
    finally:
        rc.read_fleet = rc_read
    assert res.written and res.conflicts == 1 and calls == 2
    epoch = PlacementEpoch.from_json((await store.get(keys.placement_epoch)).value)
    assert epoch.counter == 100  # bumped on top of the concurrent writer's value


async def test_conflict_error_after_bounded_attempts(store, keys, monkeypatch):
    await put_nodes(store, keys, node("a"))

    async def always_lose(store_, keys_, p, **kw):
        return False

    monkeypatch.setattr(rc, "apply_plan", always_lose)
    with pytest.raises(rc.ConflictError, match="3 times"):
        await rc.reconcile(store, keys, intent(), max_attempts=3)


async def test_stale_assignment_compare(store, keys):
    """Overwriting an assignment someone else changed since our read fails too."""
    await put_nodes(store, keys, node("a"))
    await rc.reconcile(store, keys, intent())
    view = await rc.read_fleet(store, keys)
    p = rc.plan(keys, view, "ns", "llm", intent(gen=2, uri="/models/y"))
    assert p.ops
    await store.put(keys.assignment("a", "ns", "llm", "v1"), assignment(gen=3).to_json())
    assert not await rc.apply_plan(store, keys, p)
    assert (await stored(store, keys))[("a", "v1")].generation == 3


async def test_delete_removes_all(store, keys):
    await put_nodes(store, keys, node("a"), node("b"), node("c"))
    await rc.reconcile(store, keys, intent("keep"))
    await rc.reconcile(store, keys, intent(replicas=3))
    await rc.reconcile(store, keys, intent(replicas=3, rev="v2", gen=2))  # a second revision
    assert await roles(store, keys) == {(n, r, role) for n in "abc" for r, role in (
        ("v1", Role.PREVIOUS), ("v2", Role.STABLE))}
    res = await rc.remove_deployment(store, keys, "ns", "llm")
    assert res.written and set(res.decision.removed) == {"a", "b", "c"}
    left = await store.list(keys.assignments_prefix)
    assert [keys.parse_assignment(kv.key)[2] for kv in left.items] == ["keep"]
    before = await revision(store)
    assert not (await rc.remove_deployment(store, keys, "ns", "llm")).written
    assert await revision(store) == before


async def test_node_gone_moves_replica(store, keys):
    await put_nodes(store, keys, node("a", 32), node("b", 16))
    res = await rc.reconcile(store, keys, intent())
    assert res.decision.nodes == ("a",)
    await store.delete(keys.node("a"))
    res2 = await rc.reconcile(store, keys, intent())
    assert res2.written and res2.decision.nodes == ("b",) and res2.decision.removed == ("a",)
    assert await stored(store, keys) == {("b", "v1"): assignment()}


async def test_other_deployments_memory_from_etcd(store, keys):
    await put_nodes(store, keys, node("a", 10), node("b", 10))
    await store.txn([], [Put(keys.assignment("a", "ns", "big", "v1"),
                             assignment("big", mem_gib=7).to_json())])
    res = await rc.reconcile(store, keys, intent(mem_gib=2, replicas=2))
    assert res.decision.nodes == ("b",) and res.decision.unplaced == 1
    assert "1 insufficient memory (needs 2.0GiB: a 1.0GiB free of 8.0GiB)" in res.decision.message


class _RacyStore:
    """Wraps the store: right after its ``n``-th read (``get`` or ``list``, 1-based) returns,
    ``hook`` runs a whole competing reconcile, i.e. a write lands in the middle of our read."""

    def __init__(self, inner, n: int, hook) -> None:
        self.inner, self.n, self.hook, self.reads = inner, n, hook, 0

    def __getattr__(self, attr):
        return getattr(self.inner, attr)

    async def _after_read(self, result):
        self.reads += 1
        if self.reads == self.n:
            await self.hook()
        return result

    async def get(self, key):
        return await self._after_read(await self.inner.get(key))

    async def list(self, prefix):
        return await self._after_read(await self.inner.list(prefix))


@pytest.mark.parametrize("after_read", [1, 2, 3], ids=["after-1st-read", "after-2nd-read",
                                                       "after-3rd-read"])
async def test_write_during_read_never_overcommits(store, keys, after_read):
    """A competing placement committed anywhere after our epoch read (which must come first:
    between it and the lists, between the lists, after them) fails our compare; the retry
    sees its memory. One 10 GiB node = 8 GiB budget: only one of two 6 GiB deployments fits."""
    await put_nodes(store, keys, node("a", 10))
    other_result = []

    async def other():
        other_result.append(await rc.reconcile(store, keys, intent("b", mem_gib=6)))

    racy = _RacyStore(store, after_read, other)
    res = await rc.reconcile(racy, keys, intent("a", mem_gib=6))
    assert other_result and other_result[0].decision.nodes == ("a",)
    # Landing before a list, the write is simply seen; after the lists, our compare fails.
    assert res.conflicts == (1 if after_read == 3 else 0)
    assert res.decision.nodes == () and res.decision.unplaced == 1 and not res.written
    assert "insufficient memory" in res.decision.message
    listing = await store.list(keys.assignments_prefix)
    assert [keys.parse_assignment(kv.key)[2] for kv in listing.items] == ["b"]


async def test_scale_up_leaves_existing_assignments_untouched(store, keys):
    """2 → 3 replicas: the two stored assignments keep their generation and mod_revision (no
    write), so the agents' reports for them still count and readiness does not flap."""
    from mlx_fleet_operator.status import StatusInput, compute_status

    await put_nodes(store, keys, node("a"), node("b"), node("c"))
    first = await rc.reconcile(store, keys, intent(replicas=2, gen=1))
    assert first.decision.nodes == ("a", "b")
    revs = {kv.key: kv.mod_revision for kv in (await store.list(keys.assignments_prefix)).items}
    reports = ready(("a", "v1"), ("b", "v1"), gen=1)

    res = await rc.reconcile(store, keys, intent(replicas=3, gen=2), reports)
    assert res.written and res.decision.added == ("c",)
    after = {kv.key: kv.mod_revision for kv in (await store.list(keys.assignments_prefix)).items}
    assert {k: after[k] for k in revs} == revs
    assert {n: a.generation for (n, _), a in (await stored(store, keys)).items()} == {
        "a": 1, "b": 1, "c": 2}
    status, _ = compute_status(StatusInput(generation=2, replicas=3, assignments=res.assignments,
                                           reports=reports))
    assert status["readyReplicas"] == 2 and status["observedGeneration"] == 2
    assert status["endpoints"] == ["http://a:8000", "http://b:8000"]


async def test_concurrent_reconciles_after_node_death_all_converge(store, keys):
    """The Mac hosting 12 deployments dies: all 12 reconcile at once against the one global
    epoch. Backoff between retries lets every one of them land (none left unplaced)."""
    await put_nodes(store, keys, node("a", 64))
    names = [f"d{i}" for i in range(12)]
    for n in names:
        await rc.reconcile(store, keys, intent(n, mem_gib=1))
    await put_nodes(store, keys, node("b", 64))
    await store.delete(keys.node("a"))
    results = await asyncio.gather(*[
        rc.reconcile(store, keys, intent(n, mem_gib=1)) for n in names], return_exceptions=True)
    assert [r for r in results if isinstance(r, BaseException)] == []
    assert all(r.decision.nodes == ("b",) for r in results)
    listing = await store.list(keys.assignments_prefix)
    assert sorted(keys.parse_assignment(kv.key)[::2] for kv in listing.items) == [
        ("b", n) for n in sorted(names)]


async def test_serialized_reconciles_of_one_process_never_race(store, keys):
    """The operator's reconciles share one lock (``serialize``): 20 at once all land in their
    first transaction, while the epoch still fences any other writer."""
    await put_nodes(store, keys, node("a", 64), node("b", 64))
    lock = asyncio.Lock()
    names = [f"s{i}" for i in range(20)]
    results = await asyncio.gather(*[
        rc.reconcile(store, keys, intent(n, mem_gib=1), serialize=lock) for n in names])
    assert [r.conflicts for r in results] == [0] * 20 and all(r.written for r in results)
    assert len((await store.list(keys.assignments_prefix)).items) == 20


def test_backoff_delays_grow_jittered_and_capped():
    import random

    rng = random.Random(7)
    for attempt in range(1, 12):
        cap = min(rc.BACKOFF_MAX_SECONDS, rc.BACKOFF_BASE_SECONDS * 2 ** (attempt - 1))
        delays = [rc.backoff_delay(attempt, rng) for _ in range(50)]
        assert all(0 <= d <= cap for d in delays) and len(set(delays)) > 1  # jittered
    assert rc.BACKOFF_BASE_SECONDS == 0.02 and rc.BACKOFF_MAX_SECONDS == 0.5


def _stored(keys, node_, ns, name, uid="u1", rev="v1"):
    from mlx_fleet.store import KV

    a = assignment(name, rev=rev).model_copy(update={"namespace": ns, "uid": uid})
    key = keys.assignment(node_, ns, name, rev)
    return rc.StoredAssignment(key, KV(key, a.to_json(), 5), a)


ORPHAN_CASES = [
    # id, stored (node, ns, name, uid), live {(ns, name): uids}, watched namespaces, orphans
    ("live object kept", [("a", "ns", "llm", "u1")], {("ns", "llm"): {"u1"}}, None, []),
    ("object gone", [("a", "ns", "llm", "u1")], {}, None, [("a", "ns", "llm", "v1")]),
    ("re-created object (new uid)", [("a", "ns", "llm", "u1")], {("ns", "llm"): {"u2"}}, None,
     [("a", "ns", "llm", "v1")]),
    ("legacy assignment without uid kept", [("a", "ns", "llm", "")], {("ns", "llm"): {"u2"}},
     None, []),
    ("unwatched namespace never touched", [("a", "other", "llm", "u1")], {}, {"ns"}, []),
    ("every replica of a gone object", [("a", "ns", "x", "u"), ("b", "ns", "x", "u"),
                                        ("b", "ns", "llm", "u1")], {("ns", "llm"): {"u1"}},
     {"ns"}, [("a", "ns", "x", "v1"), ("b", "ns", "x", "v1")]),
    ("every revision of a gone object", [("a", "ns", "x", "u", "v1"), ("a", "ns", "x", "u", "v2"),
                                         ("a", "ns", "llm", "u1", "v2")],
     {("ns", "llm"): {"u1"}}, None, [("a", "ns", "x", "v1"), ("a", "ns", "x", "v2")]),
]


@pytest.mark.parametrize("stored_, live, watched, want", [c[1:] for c in ORPHAN_CASES],
                         ids=[c[0] for c in ORPHAN_CASES])
def test_find_orphans(stored_, live, watched, want):
    keys = Keys("/t")
    view = rc.FleetView(nodes={}, assignments={}, epoch=None, revision=5)
    for n, ns, name, uid, *rev in stored_:
        view.assignments.setdefault(n, []).append(_stored(keys, n, ns, name, uid, *rev))
    got = rc.find_orphans(view, keys, live, lambda ns: watched is None or ns in watched)
    assert [keys.parse_assignment(s.key) for s in got] == want


async def test_collect_garbage_deletes_orphans_fenced(store, keys):
    await put_nodes(store, keys, node("a"), node("b"))
    await rc.reconcile(store, keys, intent("keep"))
    await rc.reconcile(store, keys, intent("gone", replicas=2))
    live = {("ns", "keep"): {""}}
    deleted = await rc.collect_garbage(store, keys, live, lambda ns: True)
    assert sorted(keys.parse_assignment(k)[2] for k in deleted) == ["gone", "gone"]
    assert [a.name for a in (await stored(store, keys)).values()] == ["keep"]
    before = await revision(store)
    assert await rc.collect_garbage(store, keys, live, lambda ns: True) == []
    assert await revision(store) == before


# --- revisions: rolling update, candidate, promotion through etcd -----------------------------


async def test_revision_edit_rolls_out_as_reports_arrive(store, keys):
    """v1 on a and b; edit to v2: v2 is written next to v1 (which turns Previous, keeping its
    generation, so its Ready report still counts); each v1 goes once v2 is Ready on its node."""
    await put_nodes(store, keys, node("a"), node("b"), node("c"))
    await rc.reconcile(store, keys, intent(replicas=2, gen=1))
    reports = ready(("a", "v1"), ("b", "v1"), gen=1)

    r1 = await rc.reconcile(store, keys, intent(replicas=2, gen=2, rev="v2"), reports)
    assert r1.written and r1.rollout.reason == "RollingUpdate"
    assert await roles(store, keys) == {("a", "v2", Role.STABLE), ("b", "v2", Role.STABLE),
                                        ("a", "v1", Role.PREVIOUS), ("b", "v1", Role.PREVIOUS)}
    s = await stored(store, keys)
    assert s[("a", "v1")].generation == 1 and s[("a", "v2")].generation == 2
    assert set(r1.assignments) == set(s)
    before = await revision(store)
    assert not (await rc.reconcile(store, keys, intent(replicas=2, gen=2, rev="v2"),
                                   reports)).written  # nothing changed: nothing written
    assert await revision(store) == before

    reports |= ready(("a", "v2"), gen=2)
    r2 = await rc.reconcile(store, keys, intent(replicas=2, gen=2, rev="v2"), reports)
    assert r2.written and r2.rollout.reason == "RollingUpdate"
    assert r2.rollout.previous == (("b", "v1"),)
    assert await roles(store, keys) == {("a", "v2", Role.STABLE), ("b", "v2", Role.STABLE),
                                        ("b", "v1", Role.PREVIOUS)}

    reports |= ready(("b", "v2"), gen=2)
    r3 = await rc.reconcile(store, keys, intent(replicas=2, gen=2, rev="v2"), reports)
    assert r3.written and r3.rollout.reason == "Complete"
    assert await roles(store, keys) == {("a", "v2", Role.STABLE), ("b", "v2", Role.STABLE)}


async def test_stale_report_does_not_advance_the_rollout(store, keys):
    await put_nodes(store, keys, node("a"))
    await rc.reconcile(store, keys, intent(gen=1))
    await rc.reconcile(store, keys, intent(gen=2, rev="v2"), ready(("a", "v1"), gen=1))
    # a report of v2 for an older generation than the stored record's
    res = await rc.reconcile(store, keys, intent(gen=2, rev="v2"),
                             ready(("a", "v1"), gen=1) | ready(("a", "v2"), gen=1))
    assert not res.written and res.rollout.reason == "RollingUpdate"
    assert ("a", "v1", Role.PREVIOUS) in await roles(store, keys)


async def test_failed_revision_stalls_and_keeps_the_previous(store, keys):
    await put_nodes(store, keys, node("a"))
    await rc.reconcile(store, keys, intent(gen=1))
    await rc.reconcile(store, keys, intent(gen=2, rev="v2"), ready(("a", "v1"), gen=1))
    reports = ready(("a", "v1"), gen=1) | ready(("a", "v2"), gen=2,
                                               state=AssignmentState.FAILED)
    res = await rc.reconcile(store, keys, intent(gen=2, rev="v2"), reports)
    assert res.rollout.reason == "Stalled" and "failed on a" in res.rollout.message
    assert await roles(store, keys) == {("a", "v2", Role.STABLE), ("a", "v1", Role.PREVIOUS)}


async def test_candidate_placed_then_promoted(store, keys):
    await put_nodes(store, keys, node("a"), node("b"))
    await rc.reconcile(store, keys, intent(replicas=2, gen=1))
    res = await rc.reconcile(store, keys, intent(replicas=2, gen=1, candidate="v3"),
                             ready(("a", "v1"), ("b", "v1"), gen=1))
    assert res.written and res.candidate is not None and res.candidate.nodes == ("a",)
    assert await roles(store, keys) == {("a", "v1", Role.STABLE), ("b", "v1", Role.STABLE),
                                        ("a", "v3", Role.CANDIDATE)}
    assert res.assignments[("a", "v3")].role == Role.CANDIDATE

    # promotion: spec.model.revision becomes v3, the candidate intent goes away
    reports = ready(("a", "v1"), ("b", "v1"), ("a", "v3"), gen=1)
    res2 = await rc.reconcile(store, keys, intent(replicas=2, gen=2, rev="v3"), reports)
    assert await roles(store, keys) == {("a", "v3", Role.STABLE), ("b", "v3", Role.STABLE),
                                        ("b", "v1", Role.PREVIOUS)}
    assert res2.rollout.reason == "RollingUpdate"
    reports |= ready(("a", "v3"), ("b", "v3"), gen=2)
    res3 = await rc.reconcile(store, keys, intent(replicas=2, gen=2, rev="v3"), reports)
    assert res3.rollout.reason == "Complete"
    assert await roles(store, keys) == {("a", "v3", Role.STABLE), ("b", "v3", Role.STABLE)}


async def test_malformed_records_of_any_revision_are_rewritten_or_removed(store, keys):
    await put_nodes(store, keys, node("a"))
    await store.put(keys.assignment("a", "ns", "llm", "v1"), b"{not json")
    await store.put(keys.assignment("a", "ns", "llm", "v0"), b"{not json either")
    await store.put(keys.assignment("a", "ns", "other", "v0"), b"garbage of another deployment")
    res = await rc.reconcile(store, keys, intent())
    assert res.written and res.assignments == {("a", "v1"): assignment()}
    left = {kv.key: kv.value for kv in (await store.list(keys.assignments_prefix)).items}
    assert left == {keys.assignment("a", "ns", "llm", "v1"): assignment().to_json(),
                    keys.assignment("a", "ns", "other", "v0"): b"garbage of another deployment"}


async def test_parse_memo_reuses_unchanged_records_and_sees_changes(store, keys):
    """read_fleet with a memo gives the same view as without, parses only what changed, and
    drops keys that went."""
    await put_nodes(store, keys, node("a", 64), node("b", 64))
    await rc.reconcile(store, keys, intent("m1", mem_gib=1))
    memo = (rc.ParseMemo(), rc.ParseMemo())
    first = await rc.read_fleet(store, keys, memo)
    again = await rc.read_fleet(store, keys, memo)
    assert again.nodes == first.nodes and again.assignments == first.assignments
    assert again.nodes["a"] is first.nodes["a"]                    # reused, not re-parsed
    await put_nodes(store, keys, node("a", 32))                   # a changed record
    await store.delete(keys.node("b"))                            # a record gone
    changed = await rc.read_fleet(store, keys, memo)
    assert changed.nodes == (await rc.read_fleet(store, keys)).nodes
    assert changed.nodes["a"].capacity.memory_total_bytes == 32 * 2**30
    assert set(changed.nodes) == {"a"} and len(memo[0]._seen) == 1


class _CountingStore:
    """Wraps the store, counting the prefixes it lists."""

    def __init__(self, inner) -> None:
        self.inner, self.listed = inner, []

    def __getattr__(self, attr):
        return getattr(self.inner, attr)

    async def list(self, prefix):
        self.listed.append(prefix)
        return await self.inner.list(prefix)


async def test_followed_views_replace_the_listings(store, keys):
    """With the operator's views (followed node records, AssignmentsView) a reconcile reads the
    epoch only: the assignments are listed once, to load the view; its own commits keep the view
    current, and it plans exactly what a reconcile that lists everything plans."""
    from mlx_fleet_operator.view import AssignmentsView

    await put_nodes(store, keys, node("a", 16), node("b", 32), node("c", 8))
    nodes = dict((await rc.read_fleet(store, keys)).nodes)
    counting, view = _CountingStore(store), AssignmentsView()
    results = [await rc.reconcile(counting, keys, intent(f"d{i}", mem_gib=6), nodes=nodes,
                                  assignments=view) for i in range(4)]
    assert counting.listed == [keys.assignments_prefix]
    assert [r.decision.nodes for r in results] == [("b",), ("b",), ("b",), ("a",)]
    listing = await store.list(keys.assignments_prefix)
    assert [(kv.key, kv.value, kv.mod_revision) for kv in view.items()] == [
        (kv.key, kv.value, kv.mod_revision) for kv in listing.items]
    from_view = rc.plan(keys, await rc.read_fleet(counting, keys, nodes=nodes, assignments=view),
                        "ns", "d4", intent("d4", mem_gib=6))
    listed = rc.plan(keys, await rc.read_fleet(store, keys), "ns", "d4", intent("d4", mem_gib=6))
    assert from_view == listed and from_view.decision.nodes == ("b",)
    assert counting.listed == [keys.assignments_prefix]
    # nothing changed since: the same FleetView again (its indexes built once)
    first = await rc.read_fleet(counting, keys, nodes=nodes, assignments=view)
    assert await rc.read_fleet(counting, keys, nodes=nodes, assignments=view) is first
    await rc.reconcile(counting, keys, intent("d4", mem_gib=6), nodes=nodes, assignments=view)
    assert await rc.read_fleet(counting, keys, nodes=nodes, assignments=view) is not first


async def test_followed_view_never_overcommits_on_a_write_it_has_not_seen(store, keys):
    """Another writer (another operator replica, not through our view) commits right after our
    epoch read: the view does not hold its assignment, so our transaction fails its compare;
    the retry finds the view behind the epoch, lists, and sees the memory taken. One 10 GiB node
    = 8 GiB budget."""
    from mlx_fleet_operator.view import AssignmentsView

    await put_nodes(store, keys, node("a", 10))
    nodes = dict((await rc.read_fleet(store, keys)).nodes)
    view = AssignmentsView()
    await rc.reconcile(store, keys, intent("small", mem_gib=1), nodes=nodes, assignments=view)
    other = []

    async def other_replica():
        other.append(await rc.reconcile(store, keys, intent("b", mem_gib=6)))

    counting = _CountingStore(_RacyStore(store, 1, other_replica))
    res = await rc.reconcile(counting, keys, intent("a", mem_gib=6), nodes=nodes,
                             assignments=view)
    assert other and other[0].decision.nodes == ("a",)
    assert res.conflicts == 1 and not res.written
    assert res.decision.nodes == () and res.decision.unplaced == 1
    assert counting.listed == [keys.assignments_prefix]  # the retry's listing
    listing = await store.list(keys.assignments_prefix)
    assert sorted(keys.parse_assignment(kv.key)[::2] for kv in listing.items) == [
        ("a", "b"), ("a", "small")]


async def test_held_nodes_are_read_with_the_fleet_not_before(store, keys):
    """The vanished nodes whose replicas are held (a control-plane disruption) are asked for
    when the fleet is read, inside the placement lock: a node that vanished while this
    reconcile waited for the lock is held by it, not dropped (the race seen in the
    etcd-frozen fault: a report deletion woke the reconcile just before the node record
    went). Without ``held`` the same reconcile drops the replica (node loss)."""
    await put_nodes(store, keys, node("mac-a"), node("mac-b"))
    res = await rc.reconcile(store, keys, intent(replicas=2))
    assert set(res.assignments) == {("mac-a", "v1"), ("mac-b", "v1")}
    await store.delete(keys.node("mac-a"))  # vanished while the next reconcile was queued
    asked = []

    def held() -> frozenset[str]:
        asked.append(True)
        return frozenset({"mac-a"})

    kept = await rc.reconcile(store, keys, intent(replicas=2), held=held)
    assert asked and set(kept.assignments) == {("mac-a", "v1"), ("mac-b", "v1")}
    assert not kept.written
    dropped = await rc.reconcile(store, keys, intent(replicas=2))
    assert set(dropped.assignments) == {("mac-b", "v1")}
