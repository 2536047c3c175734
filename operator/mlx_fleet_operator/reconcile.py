"""The thin I/O around placement: read etcd, decide, write one fenced transaction.

:func:`reconcile` (one ModelDeployment):

1. :func:`read_fleet` gets ``placement-epoch`` FIRST, then lists ``nodes/`` and
   ``assignments/`` (the order matters, see :func:`read_fleet`) — or, in the operator, takes
   them from its followers' in-memory views when those cover the epoch (:mod:`.view`);
2. :func:`plan` runs :func:`~mlx_fleet_operator.rollout.plan_deployment` (every revision the
   deployment should hold: stable, previous ones still rolling out, a canary's candidate) and
   diffs the desired (node, revision) assignments against the stored ones → puts and deletes;
3. if there is nothing to change, nothing is written (no transaction at all);
4. otherwise :func:`apply_plan` commits the puts/deletes in ONE ``store.txn`` whose compares are
   the ``mod_revision`` of ``placement-epoch`` (0 when absent) and of every assignment key of
   this deployment that was read (0 for keys about to be created), bumping the epoch in the
   same transaction. A failed compare means someone wrote in between: wait a jittered,
   exponentially growing moment (:func:`backoff_delay`, 20 ms doubling up to 500 ms) so that
   many deployments re-placed at once (a Mac died) stop colliding on the one epoch, then
   re-read and retry, up to ``max_attempts`` times; then raise :class:`ConflictError`. A
   concurrent writer is never clobbered.

:func:`remove_deployment` deletes every assignment of a deployment under the same fencing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import random
import socket
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence

from pydantic import ValidationError

from typing import Any

from mlx_fleet.contract import (Assignment, AssignmentReport, AssignmentState, Keys, NodeRecord,
                                PlacementEpoch)
from mlx_fleet.routing import replicas
from mlx_fleet.store import KV, Compare, Delete, Put, Store

from .holders import current_report
from .placement import PlacementDecision
from .view import AssignmentsView
from .rollout import (DeploymentPlan, DrainState, RevisionTarget, RolloutState, Slot,
                      plan_deployment, same_for_node)
from .spec import pin_replicas

log = logging.getLogger(__name__)

DEFAULT_WRITER = f"mlx-fleet-operator@{socket.gethostname()}"
#: Attempts of one reconcile before :class:`ConflictError` (each after a failed compare).
MAX_ATTEMPTS = 8
#: Backoff between attempts: the cap doubles from BASE to MAX; the delay is uniform in [0, cap].
BACKOFF_BASE_SECONDS = 0.02
BACKOFF_MAX_SECONDS = 0.5


def backoff_delay(attempt: int, rng: random.Random | None = None) -> float:
    """Seconds to wait after the ``attempt``-th (1-based) failed transaction: "full jitter",
    uniform in ``[0, min(MAX, BASE × 2^(attempt-1))]``, so racing reconciles spread out."""
    cap = min(BACKOFF_MAX_SECONDS, BACKOFF_BASE_SECONDS * 2 ** max(attempt - 1, 0))
    return (rng or random).uniform(0, cap)


class ConflictError(RuntimeError):
    """The fenced transaction kept failing its compares (heavy contention); retry later.
    ``conflicts``: how many transactions failed."""

    def __init__(self, message: str, conflicts: int) -> None:
        super().__init__(message)
        self.conflicts = conflicts


@dataclasses.dataclass(frozen=True)
class StoredAssignment:
    key: str
    kv: KV
    assignment: Assignment | None  # None when the stored value is unparseable


@dataclasses.dataclass(frozen=True)
class FleetView:
    """A consistent-enough read of the fleet. ``assignments``: node → stored assignments."""

    nodes: dict[str, NodeRecord]
    assignments: dict[str, list[StoredAssignment]]
    epoch: KV | None
    revision: int

    def of(self, namespace: str, name: str) -> dict[Slot, StoredAssignment]:
        """(node, revision) → this deployment's stored assignment (parseable ones)."""
        return dict(self._by_deployment.get((namespace, name), {}))

    @functools.cached_property
    def _by_deployment(self) -> dict[tuple[str, str], dict[Slot, StoredAssignment]]:
        out: dict[tuple[str, str], dict[Slot, StoredAssignment]] = {}
        for node, items in self.assignments.items():
            for s in items:
                if s.assignment is not None:
                    out.setdefault((s.assignment.namespace, s.assignment.name), {})[
                        (node, s.assignment.revision)] = s
        return out

    @functools.cached_property
    def current(self) -> dict[str, list[Assignment]]:
        """node → its parseable stored assignments (placement's input; do not modify)."""
        return {n: [s.assignment for s in items if s.assignment is not None]
                for n, items in self.assignments.items()}


@dataclasses.dataclass(frozen=True)
class Intent:
    """What the operator wants for one deployment: the ``stable`` revision, a Canary's
    ``candidate`` (or None), the rolling-update limits resolved against ``replicas``."""

    stable: RevisionTarget
    candidate: RevisionTarget | None = None
    max_surge: int = 1
    max_unavailable: int = 1
    min_ready: int = 0  # spec.lifecycle.minReady: replicas pinned resident (spec.pin_replicas)
    #: vanished nodes whose replicas are kept (a control-plane disruption, :mod:`.disruption`)
    held: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True)
class Plan:
    """What to write for one deployment. Empty ``ops`` means: already converged."""

    decision: PlacementDecision
    ops: tuple[Put | Delete, ...]
    compares: tuple[Compare, ...]
    epoch: KV | None
    desired: dict[Slot, Assignment]  # (node, revision) → assignment once applied (kept
    # records keep their stored generation, see rollout.same_for_node)
    candidate: PlacementDecision | None = None
    rollout: RolloutState = RolloutState()
    drain: DrainState = DrainState()


@dataclasses.dataclass(frozen=True)
class ReconcileResult:
    decision: PlacementDecision
    assignments: dict[Slot, Assignment]  # (node, revision) → this deployment's assignments
    written: bool
    conflicts: int
    candidate: PlacementDecision | None = None
    rollout: RolloutState = RolloutState()
    drain: DrainState = DrainState()


class ParseMemo:
    """Parsed records by key, reused while the key's ``mod_revision`` is unchanged (records are
    frozen). With 1 000 Macs and 1 000 assignments, parsing every record on every reconcile was
    most of a reconcile's time; with the memo only what changed since the last read is parsed.
    One memo per listing (its keys are the listing's); keys not in the latest listing are
    dropped, so it never outgrows the fleet. A malformed record is logged once per version."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[int, Any]] = {}

    def parse(self, items: Sequence[KV], parse: Callable[[KV], Any]) -> list[tuple[KV, Any]]:
        """``[(kv, parse(kv))]`` for ``items``, the parse of an unchanged key reused."""
        out, seen = [], {}
        for kv in items:
            hit = self._seen.get(kv.key)
            value = hit[1] if hit is not None and hit[0] == kv.mod_revision else parse(kv)
            seen[kv.key] = (kv.mod_revision, value)
            out.append((kv, value))
        self._seen = seen
        return out


async def read_fleet(store: Store, keys: Keys, memo: tuple[ParseMemo, ParseMemo] | None = None,
                     *, nodes: Mapping[str, NodeRecord] | None = None,
                     assignments: AssignmentsView | None = None) -> FleetView:
    """Get the epoch, then list node records and assignments. Unparseable records are skipped
    (logged); an assignment key outside the layout is ignored. ``memo``: (node records,
    assignments) :class:`ParseMemo` s kept between calls by one caller (the operator's
    Runtime), so unchanged records are not parsed again.

    ``nodes``: node name → record, from a follower of ``nodes/`` (the operator's; None: list
    them). Node records are not fenced by the epoch either way: a node may vanish right after
    any read; a follower's view is as recent as a listing, give or take the watch's delay.
    ``assignments``: the operator's :class:`~.view.AssignmentsView`: used instead of listing
    when it covers the epoch just read (so the fencing below holds unchanged), else the
    listing made now resets it.

    The epoch is read before the lists on purpose: its ``mod_revision`` is what the fenced
    transaction compares, and every assignment write bumps it. Reading it first means any
    assignment write we might have missed in the lists (committed after the epoch read) has
    changed the epoch, so our compare fails and we re-read. Reading it last would let a write
    committed between the assignments list and the epoch read slip through unseen (and
    over-commit a node's memory).
    """
    epoch = await store.get(keys.placement_epoch)
    node_memo, asg_memo = memo or (ParseMemo(), ParseMemo())
    revision = 0
    if nodes is None:
        nodes_l = await store.list(keys.nodes_prefix)
        revision = nodes_l.revision
    if assignments is not None and assignments.covers(epoch.mod_revision if epoch else 0):
        cached = assignments.derived
        if (nodes is not None and cached is not None and cached[0] == assignments.changes
                and cached[1] == epoch and cached[2] == nodes):
            return cached[3]  # nothing changed since the last read: the same view (and indexes)
        asg_items, revision = assignments.items(), max(revision, assignments.complete)
    else:
        asg_l = await store.list(keys.assignments_prefix)
        if assignments is not None:
            assignments.reset(asg_l.items, asg_l.revision)
        asg_items, revision = asg_l.items, max(revision, asg_l.revision)

    def parse_node(kv: KV) -> NodeRecord | None:
        name = keys.parse_node(kv.key)
        if name is None:
            return None
        try:
            rec = NodeRecord.from_json(kv.value)
        except ValidationError as e:
            log.warning("ignoring malformed node record %s: %s", kv.key, e)
            return None
        return rec if rec.name == name else rec.model_copy(update={"name": name})

    def parse_assignment(kv: KV) -> tuple[tuple[str, str, str, str], Assignment | None] | None:
        parsed = keys.parse_assignment(kv.key)
        if parsed is None:
            return None
        try:
            a: Assignment | None = Assignment.from_json(kv.value)
        except ValidationError:
            log.warning("malformed assignment %s will be rewritten", kv.key)
            a = None
        if a is not None and (a.namespace, a.name) != parsed[1:]:
            a = a.model_copy(update={"namespace": parsed[1], "name": parsed[2]})
        return parsed, a

    if nodes is None:
        records: dict[str, NodeRecord] = {
            rec.name: rec for _, rec in node_memo.parse(nodes_l.items, parse_node)
            if rec is not None}
    else:
        records = {name: rec if rec.name == name else rec.model_copy(update={"name": name})
                   for name, rec in nodes.items()}
    stored: dict[str, list[StoredAssignment]] = {}
    for kv, got in asg_memo.parse(asg_items, parse_assignment):
        if got is not None:
            parsed, a = got
            stored.setdefault(parsed[0], []).append(StoredAssignment(kv.key, kv, a))
    view = FleetView(nodes=records, assignments=stored, epoch=epoch, revision=revision)
    if assignments is not None and nodes is not None and assignments.covers(
            epoch.mod_revision if epoch else 0):
        assignments.derived = (assignments.changes, epoch, dict(nodes), view)
    return view


def report_slots(view: FleetView, namespace: str, name: str,
                 reports: Mapping[Slot, AssignmentReport]) -> tuple[set[Slot], set[Slot]]:
    """The (node, revision) slots of a deployment whose agent reports ``Ready`` / ``Failed``
    *for the stored record's generation* (an older report describes an older record)."""
    ready: set[Slot] = set()
    failed: set[Slot] = set()
    mine = {slot: s.assignment for slot, s in view.of(namespace, name).items()}
    for slot in mine:
        r = current_report(slot, reports, mine)
        if r is None:
            continue
        if replicas.serves(r.state, r.reason):
            ready.add(slot)  # a standby replica (idle-unloaded) serves on demand
        elif r.state == AssignmentState.FAILED:
            failed.add(slot)
    return ready, failed


def plan(keys: Keys, view: FleetView, namespace: str, name: str, intent: Intent | None,
         reports: Mapping[Slot, AssignmentReport] | None = None,
         released: Collection[Slot] = ()) -> Plan:
    """Diff the desired assignments of ``namespace/name`` (``intent``; None = remove the
    deployment everywhere) against ``view``. ``reports``: (node, revision) → the agent's
    report, which a rolling update needs (a previous revision goes once the new one is Ready).
    ``released``: drained slots whose withdrawal from the endpoints is published
    (:func:`~.rollout.plan_deployment`).
    A stored record that is ``same_for_node`` as the desired one is kept as is (no write)."""
    mine = view.of(namespace, name)
    # Malformed values under this deployment's keys are rewritten or removed too.
    for node, items in view.assignments.items():
        for s in items:
            if s.assignment is not None:
                continue
            parsed = keys.parse_assignment(s.key)
            if parsed and parsed[:3] == (node, namespace, name):
                mine[(node, parsed[3])] = s
    if intent is None:
        dplan = DeploymentPlan(desired={}, stable=PlacementDecision(
            nodes=(), removed=tuple(sorted({n for n, _ in mine}))), candidate=None,
            rollout=RolloutState())
    else:
        current = view.current
        ready, failed = report_slots(view, namespace, name, reports or {})
        dplan = plan_deployment(intent.stable, intent.candidate, max_surge=intent.max_surge,
                                max_unavailable=intent.max_unavailable,
                                nodes=list(view.nodes.values()), assignments=current,
                                ready=ready, failed=failed, released=released,
                                held=intent.held)
        dplan = dataclasses.replace(dplan, desired=pin_replicas(
            dplan.desired, revision=intent.stable.request.revision, min_ready=intent.min_ready,
            stored={slot: s.assignment for slot, s in mine.items() if s.assignment is not None},
            same=same_for_node))
    ops: list[Put | Delete] = []
    compares = [Compare(keys.placement_epoch, "mod", "==",
                        view.epoch.mod_revision if view.epoch else 0)]
    for slot, wanted in sorted(dplan.desired.items()):
        have = mine.get(slot)
        if have is not None and have.assignment is wanted:
            continue  # the stored record, kept as it is
        key = keys.assignment(slot[0], namespace, name, slot[1])
        compares.append(Compare(key, "mod", "==", have.kv.mod_revision if have else 0))
        ops.append(Put(key, wanted.to_json()))
    for slot, have in sorted(mine.items()):
        if slot not in dplan.desired:
            compares.append(Compare(have.key, "mod", "==", have.kv.mod_revision))
            ops.append(Delete(have.key))
    return Plan(decision=dplan.stable, ops=tuple(ops), compares=tuple(compares),
                epoch=view.epoch, desired=dplan.desired, candidate=dplan.candidate,
                rollout=dplan.rollout, drain=dplan.drain)


async def apply_plan(store: Store, keys: Keys, p: Plan, *, writer: str = DEFAULT_WRITER) -> int:
    """Commit ``p`` in one fenced transaction that also bumps the epoch. Returns the revision
    it committed at, 0 if a compare failed (and -1 for an empty plan: nothing to commit)."""
    if not p.ops:
        return -1
    counter = 0
    if p.epoch is not None:
        try:
            counter = PlacementEpoch.from_json(p.epoch.value).counter
        except ValidationError:
            counter = 0
    bump = Put(keys.placement_epoch, PlacementEpoch(counter=counter + 1, writer=writer).to_json())
    return await store.txn(p.compares, [*p.ops, bump])


async def _converge(store: Store, keys: Keys, namespace: str, name: str, intent: Intent | None,
                    reports: Mapping[Slot, AssignmentReport] | None, *, writer: str,
                    max_attempts: int, released: Collection[Slot] = (),
                    serialize: asyncio.Lock | None = None,
                    memo: tuple[ParseMemo, ParseMemo] | None = None,
                    nodes: Mapping[str, NodeRecord] | None = None,
                    assignments: AssignmentsView | None = None,
                    held: Callable[[], frozenset[str]] | None = None) -> ReconcileResult:
    conflicts = 0
    for attempt in range(1, max_attempts + 1):
        async with serialize or contextlib.nullcontext():
            view = await read_fleet(store, keys, memo, nodes=nodes, assignments=assignments)
            if held is not None and intent is not None:  # the same moment as the view
                intent = dataclasses.replace(intent, held=held())
            p = plan(keys, view, namespace, name, intent, reports, released)
            applied = bool(p.ops) and await apply_plan(store, keys, p, writer=writer)
            if applied and assignments is not None:  # it compared the epoch the view covered
                assignments.committed(p.ops, applied, keys.assignments_prefix)
        if not p.ops:
            return ReconcileResult(p.decision, p.desired, written=False, conflicts=conflicts,
                                   candidate=p.candidate, rollout=p.rollout, drain=p.drain)
        if applied:
            log.info("%s/%s: assignments now %s%s", namespace, name,
                     [f"{n}:{r}" for n, r in sorted(p.desired)],
                     f"; {p.decision.message}" if p.decision.message else "")
            return ReconcileResult(p.decision, p.desired, written=True, conflicts=conflicts,
                                   candidate=p.candidate, rollout=p.rollout, drain=p.drain)
        conflicts += 1
        log.info("%s/%s: placement transaction lost a race (attempt %d/%d); re-reading",
                 namespace, name, attempt, max_attempts)
        if attempt < max_attempts:
            await asyncio.sleep(backoff_delay(attempt))
    raise ConflictError(f"{namespace}/{name}: placement transaction failed its "
                        f"compares {max_attempts} times in a row", conflicts)


async def reconcile(store: Store, keys: Keys, intent: Intent,
                    reports: Mapping[Slot, AssignmentReport] | None = None, *,
                    writer: str = DEFAULT_WRITER, max_attempts: int = MAX_ATTEMPTS,
                    released: Collection[Slot] = (),
                    serialize: asyncio.Lock | None = None,
                    memo: tuple[ParseMemo, ParseMemo] | None = None,
                    nodes: Mapping[str, NodeRecord] | None = None,
                    assignments: AssignmentsView | None = None,
                    held: Callable[[], frozenset[str]] | None = None) -> ReconcileResult:
    """Store the assignments ``intent`` asks for (module docstring). ``reports``: (node,
    revision) → this deployment's agent reports (a rolling update advances on them).
    ``released``: see :func:`plan`. ``serialize``: a lock that the read-plan-write of every
    reconcile of this process holds (the operator's): all of them fence on the one placement
    epoch, so run concurrently they would mostly lose races to each other (measured with
    500 deployments: most transactions failed their compares); the epoch still fences other
    writers (another operator replica, the garbage collector). ``memo``: see
    :func:`read_fleet`. ``nodes`` / ``assignments``: the operator's followed views (see
    :func:`read_fleet`); the assignments view also takes this reconcile's committed writes.
    ``held``: called when the fleet is read, the vanished nodes whose replicas are kept
    (``Intent.held``, :mod:`.disruption`) — read at the same moment as ``nodes``: a set taken
    earlier, before a node vanished from the view, would let its replicas be dropped.

    Writes nothing when the stored state already matches. Raises :class:`ConflictError` after
    ``max_attempts`` lost races, ``StoreError`` when etcd is unreachable.
    """
    req = intent.stable.request
    return await _converge(store, keys, req.namespace, req.name, intent, reports,
                           writer=writer, max_attempts=max_attempts, released=released,
                           serialize=serialize, memo=memo, nodes=nodes, assignments=assignments,
                           held=held)


async def remove_deployment(store: Store, keys: Keys, namespace: str, name: str, *,
                            writer: str = DEFAULT_WRITER, max_attempts: int = MAX_ATTEMPTS,
                            serialize: asyncio.Lock | None = None,
                            memo: tuple[ParseMemo, ParseMemo] | None = None,
                            nodes: Mapping[str, NodeRecord] | None = None,
                            assignments: AssignmentsView | None = None) -> ReconcileResult:
    """Delete every assignment (every revision) of ``namespace/name``, fenced (and
    ``serialize``-d) like :func:`reconcile`."""
    return await _converge(store, keys, namespace, name, None, None, writer=writer,
                           max_attempts=max_attempts, serialize=serialize, memo=memo,
                           nodes=nodes, assignments=assignments)


def assignments_of(view: FleetView, namespace: str, name: str) -> Mapping[Slot, Assignment]:
    """(node, revision) → this deployment's parseable stored assignment."""
    return {slot: s.assignment for slot, s in view.of(namespace, name).items() if s.assignment}


def find_orphans(view: FleetView, keys: Keys, live: Mapping[tuple[str, str], Collection[str]],
                 in_scope: Callable[[str], bool]) -> list[StoredAssignment]:
    """Stored assignments whose ModelDeployment no longer exists. Pure.

    ``live``: (namespace, name) → the uids of the ModelDeployments that exist (complete: the
    caller's initial listing must be done). ``in_scope(namespace)``: whether this operator
    watches that namespace — assignments elsewhere are never touched. An assignment is an
    orphan when no live object has its (namespace, name), or when it records a uid and no
    live object of that name has it (the object was deleted and re-created). Malformed values
    count by their key's (namespace, name)."""
    out = []
    for node in sorted(view.assignments):
        for s in view.assignments[node]:
            parsed = keys.parse_assignment(s.key)
            if parsed is None or not in_scope(parsed[1]):
                continue
            uids = live.get((parsed[1], parsed[2]))
            uid = s.assignment.uid if s.assignment is not None else ""
            if not uids or (uid and uid not in uids):
                out.append(s)
    return out


LiveObjects = Mapping[tuple[str, str], Collection[str]]


async def collect_garbage(store: Store, keys: Keys,
                          live: LiveObjects | Callable[[], Awaitable[LiveObjects]],
                          in_scope: Callable[[str], bool], *,
                          writer: str = DEFAULT_WRITER) -> list[str]:
    """Delete the :func:`find_orphans` assignments in one fenced transaction (epoch and every
    deleted key compared, epoch bumped). Returns the deleted keys; ``[]`` when there were none
    or the transaction lost a race (the next round retries).

    ``live`` may be an async function listing the live objects: it is called *after* etcd is
    read, so an assignment in that read was written before the listing started, and its
    object, if it still exists, is in the listing (listing first could see a brand-new object's
    assignment but not the object). An exception from it propagates: no listing, no collection."""
    view = await read_fleet(store, keys)
    if callable(live):
        live = await live()
    orphans = find_orphans(view, keys, live, in_scope)
    if not orphans:
        return []
    compares = [Compare(keys.placement_epoch, "mod", "==",
                        view.epoch.mod_revision if view.epoch else 0)]
    compares += [Compare(s.key, "mod", "==", s.kv.mod_revision) for s in orphans]
    p = Plan(decision=PlacementDecision(nodes=()), ops=tuple(Delete(s.key) for s in orphans),
             compares=tuple(compares), epoch=view.epoch, desired={})
    if not await apply_plan(store, keys, p, writer=writer):
        log.info("garbage collection lost a race; retrying next round")
        return []
    deleted = [s.key for s in orphans]
    log.info("removed %d orphaned assignment(s) (their ModelDeployment is gone): %s",
             len(deleted), deleted)
    return deleted
