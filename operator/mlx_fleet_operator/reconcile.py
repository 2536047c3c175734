"""The thin I/O around placement: read etcd, decide, write one fenced transaction.

:func:`reconcile` (one ModelDeployment):

1. :func:`read_fleet` gets ``placement-epoch`` FIRST, then lists ``nodes/`` and
   ``assignments/`` (the order matters, see :func:`read_fleet`);
2. :func:`plan` runs :func:`~mlx_fleet_operator.placement.place` and diffs the desired
   assignments of this deployment against the stored ones → puts and deletes;
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
import dataclasses
import logging
import random
import socket
from collections.abc import Awaitable, Callable, Collection, Mapping

from pydantic import ValidationError

from mlx_fleet.contract import Assignment, Keys, NodeRecord, PlacementEpoch
from mlx_fleet.store import KV, Compare, Delete, Put, Store

from .placement import PlacementDecision, PlacementRequest, place

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

    def of(self, namespace: str, name: str) -> dict[str, StoredAssignment]:
        """node → this deployment's stored assignment."""
        out = {}
        for node, items in self.assignments.items():
            for s in items:
                if s.assignment is not None and (s.assignment.namespace, s.assignment.name) == (
                        namespace, name):
                    out[node] = s
        return out


@dataclasses.dataclass(frozen=True)
class Plan:
    """What to write for one deployment. Empty ``ops`` means: already converged."""

    decision: PlacementDecision
    ops: tuple[Put | Delete, ...]
    compares: tuple[Compare, ...]
    epoch: KV | None
    desired: dict[str, Assignment]  # node → assignment once the plan is applied (kept
    # records keep their stored generation, see same_for_node)


@dataclasses.dataclass(frozen=True)
class ReconcileResult:
    decision: PlacementDecision
    assignments: dict[str, Assignment]  # node → this deployment's assignment, as stored now
    written: bool
    conflicts: int


async def read_fleet(store: Store, keys: Keys) -> FleetView:
    """Get the epoch, then list node records and assignments. Unparseable records are skipped
    (logged); an assignment key outside the layout is ignored.

    The epoch is read before the lists on purpose: its ``mod_revision`` is what the fenced
    transaction compares, and every assignment write bumps it. Reading it first means any
    assignment write we might have missed in the lists (committed after the epoch read) has
    changed the epoch, so our compare fails and we re-read. Reading it last would let a write
    committed between the assignments list and the epoch read slip through unseen (and
    over-commit a node's memory).
    """
    epoch = await store.get(keys.placement_epoch)
    nodes_l = await store.list(keys.nodes_prefix)
    asg_l = await store.list(keys.assignments_prefix)
    nodes: dict[str, NodeRecord] = {}
    for kv in nodes_l.items:
        name = keys.parse_node(kv.key)
        if name is None:
            continue
        try:
            rec = NodeRecord.from_json(kv.value)
        except ValidationError as e:
            log.warning("ignoring malformed node record %s: %s", kv.key, e)
            continue
        nodes[name] = rec if rec.name == name else rec.model_copy(update={"name": name})
    assignments: dict[str, list[StoredAssignment]] = {}
    for kv in asg_l.items:
        parsed = keys.parse_assignment(kv.key)
        if parsed is None:
            continue
        try:
            a: Assignment | None = Assignment.from_json(kv.value)
        except ValidationError:
            log.warning("malformed assignment %s will be rewritten", kv.key)
            a = None
        if a is not None and (a.namespace, a.name) != parsed[1:]:
            a = a.model_copy(update={"namespace": parsed[1], "name": parsed[2]})
        assignments.setdefault(parsed[0], []).append(StoredAssignment(kv.key, kv, a))
    return FleetView(nodes=nodes, assignments=assignments, epoch=epoch,
                     revision=max(nodes_l.revision, asg_l.revision))


#: Assignment fields that do not change what a node does. ``generation`` is bookkeeping (which
#: spec the record was computed from); the agent's report echoes it.
_BOOKKEEPING = frozenset({"generation"})


def same_for_node(stored: Assignment, wanted: Assignment) -> bool:
    """True when ``stored`` already tells the node everything ``wanted`` does (source, revision,
    served name, memory, serving params, lifecycle, identity) — they may differ only in
    ``generation``. Such a stored assignment is left untouched (no write), so an edit that
    does not concern this node (e.g. a scale-up) does not invalidate its replica's report."""
    return (stored.model_dump(exclude=_BOOKKEEPING) == wanted.model_dump(exclude=_BOOKKEEPING))


def plan(keys: Keys, view: FleetView, request: PlacementRequest,
         assignment: Assignment | None) -> Plan:
    """Diff the placement of ``request`` against ``view``. ``assignment``: the record every
    chosen node should hold (None = remove the deployment everywhere). A node whose stored
    record is :func:`same_for_node` as ``assignment`` keeps it as is (``Plan.desired`` then
    holds the stored record, with its older generation)."""
    ns, name = request.namespace, request.name
    mine = view.of(ns, name)
    # Malformed values under this deployment's keys are rewritten or removed too.
    for node, items in view.assignments.items():
        for s in items:
            if s.assignment is None and keys.parse_assignment(s.key) == (node, ns, name):
                mine[node] = s
    if assignment is None:
        decision = PlacementDecision(nodes=(), removed=tuple(sorted(mine)))
    else:
        current = {n: [s.assignment for s in items if s.assignment is not None]
                   for n, items in view.assignments.items()}
        decision = place(request, list(view.nodes.values()), current)
    ops: list[Put | Delete] = []
    compares = [Compare(keys.placement_epoch, "mod", "==",
                        view.epoch.mod_revision if view.epoch else 0)]
    desired: dict[str, Assignment] = {}
    for node in decision.nodes:
        assert assignment is not None
        key = keys.assignment(node, ns, name)
        have = mine.get(node)
        if have is not None and have.assignment is not None and same_for_node(
                have.assignment, assignment):
            # Keep the stored record, generation included: rewriting it only to bump the
            # generation would make the agent's report look stale and flap readiness.
            desired[node] = have.assignment
            continue
        desired[node] = assignment
        compares.append(Compare(key, "mod", "==", have.kv.mod_revision if have else 0))
        ops.append(Put(key, assignment.to_json()))
    for node, have in sorted(mine.items()):
        if node not in desired:
            compares.append(Compare(have.key, "mod", "==", have.kv.mod_revision))
            ops.append(Delete(have.key))
    return Plan(decision=decision, ops=tuple(ops), compares=tuple(compares), epoch=view.epoch,
                desired=desired)


async def apply_plan(store: Store, keys: Keys, p: Plan, *, writer: str = DEFAULT_WRITER) -> bool:
    """Commit ``p`` in one fenced transaction that also bumps the epoch. True if it held."""
    if not p.ops:
        return True
    counter = 0
    if p.epoch is not None:
        try:
            counter = PlacementEpoch.from_json(p.epoch.value).counter
        except ValidationError:
            counter = 0
    bump = Put(keys.placement_epoch, PlacementEpoch(counter=counter + 1, writer=writer).to_json())
    return await store.txn(p.compares, [*p.ops, bump])


async def _converge(store: Store, keys: Keys, request: PlacementRequest,
                    assignment: Assignment | None, *, writer: str,
                    max_attempts: int) -> ReconcileResult:
    conflicts = 0
    for attempt in range(1, max_attempts + 1):
        view = await read_fleet(store, keys)
        p = plan(keys, view, request, assignment)
        if not p.ops:
            return ReconcileResult(p.decision, p.desired, written=False, conflicts=conflicts)
        if await apply_plan(store, keys, p, writer=writer):
            log.info("%s/%s: placed on %s (added %s, removed %s)%s", request.namespace,
                     request.name, list(p.decision.nodes), list(p.decision.added),
                     list(p.decision.removed),
                     f"; {p.decision.message}" if p.decision.message else "")
            return ReconcileResult(p.decision, p.desired, written=True, conflicts=conflicts)
        conflicts += 1
        log.info("%s/%s: placement transaction lost a race (attempt %d/%d); re-reading",
                 request.namespace, request.name, attempt, max_attempts)
        if attempt < max_attempts:
            await asyncio.sleep(backoff_delay(attempt))
    raise ConflictError(f"{request.namespace}/{request.name}: placement transaction failed its "
                        f"compares {max_attempts} times in a row", conflicts)


async def reconcile(store: Store, keys: Keys, request: PlacementRequest, assignment: Assignment,
                    *, writer: str = DEFAULT_WRITER, max_attempts: int = MAX_ATTEMPTS) -> ReconcileResult:
    """Place ``request`` and store ``assignment`` on the chosen nodes (module docstring).

    Writes nothing when the stored state already matches. Raises :class:`ConflictError` after
    ``max_attempts`` lost races, ``StoreError`` when etcd is unreachable.
    """
    return await _converge(store, keys, request, assignment, writer=writer,
                           max_attempts=max_attempts)


async def remove_deployment(store: Store, keys: Keys, namespace: str, name: str, *,
                            writer: str = DEFAULT_WRITER, max_attempts: int = MAX_ATTEMPTS) -> ReconcileResult:
    """Delete every assignment of ``namespace/name`` (fenced like :func:`reconcile`)."""
    request = PlacementRequest(namespace=namespace, name=name, replicas=0, memory_bytes=1)
    return await _converge(store, keys, request, None, writer=writer, max_attempts=max_attempts)


def assignments_of(view: FleetView, namespace: str, name: str) -> Mapping[str, Assignment]:
    """node → this deployment's parseable stored assignment."""
    return {n: s.assignment for n, s in view.of(namespace, name).items() if s.assignment}


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
