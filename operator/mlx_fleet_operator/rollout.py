"""Which (node, revision) assignments a ModelDeployment should have: a pure function.

A deployment can hold several revisions at once, each its own assignment on a node:

* the **stable** revision (``spec.model.revision``), placed on ``replicas`` nodes;
* **previous** revisions, while a revision edit rolls out: each keeps serving on its node until
  the stable revision is Ready there (or elsewhere), then it is removed — a surge, with
  Kubernetes Deployment semantics (``maxSurge`` / ``maxUnavailable``);
* a Canary's **candidate** revision, placed next to the stable one where both fit (placement
  counts both against the node's memory), else on nodes of its own. When the canary ends
  without a promotion (rolled back, aborted, deleted), its stored candidate records are removed
  at once.

Rolling update, one reconcile at a time (each call is one step; the next report wakes the next)
-----------------------------------------------------------------------------------------------
1. The stable revision is placed with the nodes that serve a previous revision *preferred*, so
   it loads next to the old one where memory allows (no capacity is lost at all). Nodes beyond
   the previous ones count against ``maxSurge``: the nodes serving the deployment, old or new,
   never exceed ``replicas + maxSurge``.
2. A previous revision is removed from a node when the stable revision is Ready on that node,
   or when the stable revision is Ready on ``replicas`` nodes (it is surplus).
3. Where neither fits — the stable revision could not be placed anywhere and no stable load is
   under way — a previous revision is removed from one node to make room, as long as the nodes
   still serving stay ``>= replicas - maxUnavailable``. Memory permitting, this never happens.
4. A stable replica that failed stops the rollout: no previous revision is removed to make room
   any more, and those still serving keep serving (``RolloutState.reason == "Stalled"``).

Drain (``PlacementRequest.draining``, a MacNode's ``spec.drain``)
------------------------------------------------------------------
A replica on a draining node is a replica to replace, with the same surge: placement leaves
the draining node out and adds the replacement elsewhere, and the drained replica keeps serving
(``DrainState.moving``, Ready ones only) while the revision is Ready on fewer than
``replicas`` other nodes — so a drain never lowers serving capacity, and where nothing else
fits it stays where it is
(``DrainState.blocked`` says why, with placement's numbers). This holds for every revision on
the node: stable, candidate (same rule, against the candidate's replicas) and a rollout's
previous one (kept until the stable revision is Ready on ``replicas`` nodes; never removed "to
make room" on a draining node, where nothing new may land). A drained replica that is Ready and
no longer needed is first *withdrawn* (``DrainState.withdraw``: kept, but the status leaves it
out of ``endpoints`` so clients stop sending to it) and removed once the caller says that
withdrawal is published (``released``); the agent then lets its running requests finish and
unloads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence

from mlx_fleet.contract import Assignment, NodeHealth, NodeRecord, Role

from .placement import PlacementDecision, PlacementRequest, place

Slot = tuple[str, str]  # (node, revision)


@dataclasses.dataclass(frozen=True)
class RevisionTarget:
    """One revision to place: ``request`` (its ``revision`` set) and the ``assignment`` record
    every chosen node receives."""

    request: PlacementRequest
    assignment: Assignment


@dataclasses.dataclass(frozen=True)
class RolloutState:
    """Where a revision change stands. ``reason``: ``Complete`` (no previous revision left),
    ``RollingUpdate`` (moving), ``Stalled`` (a stable replica failed; the previous revision
    keeps serving), ``Blocked`` (no room for the new revision and ``maxUnavailable`` allows no
    replacement). ``previous``: the (node, revision) slots of previous revisions kept."""

    reason: str = "Complete"
    message: str = ""
    previous: tuple[Slot, ...] = ()


@dataclasses.dataclass(frozen=True)
class DrainState:
    """Where the replicas on draining nodes stand (module docstring, *Drain*). ``moving``:
    (node, revision) slots kept serving until their replacement is Ready elsewhere;
    ``withdraw``: replaced slots kept only until their withdrawal from ``status.endpoints`` is
    published (``released``); ``blocked``: why some cannot move ("" when all can)."""

    moving: tuple[Slot, ...] = ()
    withdraw: tuple[Slot, ...] = ()
    blocked: str = ""


@dataclasses.dataclass(frozen=True)
class DeploymentPlan:
    """``desired``: every (node, revision) assignment the deployment should have (stored
    records are reused as they are where nothing but the generation would change).
    ``stable``/``candidate``: the placement decisions; ``rollout``: the revision change;
    ``drain``: the replicas on draining nodes."""

    desired: dict[Slot, Assignment]
    stable: PlacementDecision
    candidate: PlacementDecision | None
    rollout: RolloutState
    drain: DrainState = DrainState()


_BOOKKEEPING = frozenset({"generation"})


def same_for_node(stored: Assignment, wanted: Assignment) -> bool:
    """True when ``stored`` already tells the node everything ``wanted`` does — they may differ
    only in ``generation``. Such a record is left untouched (no write), so an edit that does not
    concern this node does not invalidate its replica's report."""
    return stored.model_dump(exclude=_BOOKKEEPING) == wanted.model_dump(exclude=_BOOKKEEPING)


def _pick(stored: Assignment | None, wanted: Assignment) -> Assignment:
    """The record a node should hold: the stored one when nothing but the generation differs;
    when only the ``role`` (a promoted candidate turning Stable) or the reserved
    ``memory_bytes`` (an agent's estimate replacing "not known yet") change too, the wanted one
    *with the stored generation*, so the agent's Ready report stays current (no reload, no
    Pending flicker in status)."""
    if stored is None:
        return wanted
    if same_for_node(stored, wanted):
        return stored
    if same_for_node(stored.model_copy(update={"role": wanted.role,
                                               "memory_bytes": wanted.memory_bytes}), wanted):
        return wanted.model_copy(update={"generation": stored.generation})
    return wanted


def plan_deployment(stable: RevisionTarget, candidate: RevisionTarget | None, *,
                    max_surge: int, max_unavailable: int, nodes: Sequence[NodeRecord],
                    assignments: Mapping[str, Sequence[Assignment]],
                    ready: Collection[Slot], failed: Collection[Slot] = (),
                    released: Collection[Slot] = (),
                    held: frozenset[str] = frozenset()) -> DeploymentPlan:
    """The deployment's desired assignments (module docstring).

    ``assignments``: node → every stored assignment on it (all deployments, all revisions).
    ``ready`` / ``failed``: this deployment's (node, revision) slots whose agent reports Ready /
    Failed for the stored record's generation. ``max_surge`` / ``max_unavailable``: resolved
    against ``replicas`` (:meth:`~.spec.DeploymentSpec.surge_limits`). ``released``: withdrawn
    slots on draining nodes (``DrainState.withdraw`` of an earlier plan) whose withdrawal from
    ``status.endpoints`` is published: they are removed now. ``held``: vanished nodes whose
    replicas are kept, of every revision (``place(held=...)``, :mod:`.disruption`).
    """
    req = stable.request
    me = (req.namespace, req.name)
    s_rev = req.revision
    c_rev = candidate.request.revision if candidate is not None else None
    mine: dict[Slot, Assignment] = {
        (n, a.revision): a for n, items in assignments.items() for a in items
        if (a.namespace, a.name) == me}
    # Revisions that are neither stable nor candidate: a rolling update's old ones keep serving
    # until replaced; an ended canary's candidate (stored role Candidate) goes at once — it
    # never takes stable traffic.
    prev = {slot: a for slot, a in mine.items()
            if slot[1] not in (s_rev, c_rev) and a.role != Role.CANDIDATE}
    healthy = {n.name for n in nodes if n.health == NodeHealth.HEALTHY}
    # gone nodes: dropped, unless held (a disruption: the agent is most likely still serving)
    prev = {slot: a for slot, a in prev.items() if slot[0] in healthy or slot[0] in held}
    prev_nodes = {n for n, _ in prev}
    draining = req.draining & healthy

    # 1. the stable revision, next to the previous one where it fits
    dec_s = place(dataclasses.replace(req, preferred=frozenset(prev_nodes)), nodes, assignments,
                  held=held)
    s_nodes = set(dec_s.nodes)
    if prev_nodes:
        limit = req.replicas + max_surge
        surge = [n for n in dec_s.added if n not in prev_nodes]
        while len(s_nodes | (prev_nodes - draining)) > limit and surge:
            s_nodes.discard(surge.pop())

    # 2-4. previous revisions
    ready_s = {n for n in s_nodes if (n, s_rev) in ready}
    loading_s = {n for n in s_nodes if (n, s_rev) not in ready and (n, s_rev) not in failed}
    stalled = sorted(n for n in s_nodes if (n, s_rev) in failed)
    serving = ready_s | {n for n, r in prev if (n, r) in ready}
    min_available = max(req.replicas - max_unavailable, 0)
    unplaced_s = req.replicas - dec_s.waiting - len(s_nodes)
    kept_prev: dict[Slot, Assignment] = {}
    made_room: list[Slot] = []  # removed this round so that the stable revision fits there
    blocked = False
    for slot in sorted(prev):
        node = slot[0]
        if node in ready_s or len(ready_s) >= req.replicas:
            continue  # switched on this node, or surplus
        if (node in s_nodes or stalled or loading_s or unplaced_s <= 0 or node in draining
                or node in held):
            # (nothing new lands on a draining or held node: no room is made there)
            kept_prev[slot] = prev[slot]
            continue
        if len(serving - {node}) >= min_available:
            serving.discard(node)  # make room: the stable revision lands here next round
            unplaced_s -= 1
            made_room.append(slot)
            continue
        kept_prev[slot] = prev[slot]
        blocked = True

    desired: dict[Slot, Assignment] = {}
    for n in sorted(s_nodes):
        desired[(n, s_rev)] = _pick(mine.get((n, s_rev)), stable.assignment)
    moving_s = _handover(mine, s_rev, draining, req.replicas, len(ready_s), ready)
    for slot in moving_s:
        desired[slot] = _pick(mine.get(slot), stable.assignment)
    for slot, a in kept_prev.items():
        desired[slot] = a if a.role == Role.PREVIOUS else a.model_copy(
            update={"role": Role.PREVIOUS})

    # the candidate, next to the stable revision where both fit
    dec_c: PlacementDecision | None = None
    if candidate is not None:
        after = {n: [a for a in items if (a.namespace, a.name) != me]
                 for n, items in assignments.items()}
        for (n, _), a in desired.items():
            after.setdefault(n, []).append(a)
        for (n, r), a in mine.items():
            if r == c_rev:
                after.setdefault(n, []).append(a)
        dec_c = place(dataclasses.replace(candidate.request, preferred=frozenset(s_nodes)),
                      nodes, after, held=held)
        for n in dec_c.nodes:
            desired[(n, c_rev)] = _pick(mine.get((n, c_rev)), candidate.assignment)
        ready_c = sum(1 for n in dec_c.nodes if (n, c_rev) in ready)
        moving_c = _handover(mine, c_rev or "", draining, candidate.request.replicas, ready_c,
                             ready)
        for slot in moving_c:
            desired[slot] = _pick(mine.get(slot), candidate.assignment)
    else:
        moving_c = []

    # drained replicas: withdrawn from the endpoints first, removed once that is published
    withdraw = sorted(slot for slot in mine if slot[0] in draining and slot not in desired
                      and (slot[1] in (s_rev, c_rev) or slot in prev)
                      and slot in ready and slot not in released)
    for slot in withdraw:
        desired[slot] = mine[slot]
    drain_stuck = [_stuck(moving_s, dec_s.message if dec_s.unplaced else ""),
                   _stuck(moving_c, dec_c.message if dec_c is not None and dec_c.unplaced
                          else "")]
    drain = DrainState(moving=tuple(sorted(moving_s + moving_c)), withdraw=tuple(withdraw),
                       blocked="; ".join(b for b in drain_stuck if b))

    if not kept_prev and not made_room:
        rollout = RolloutState()
    else:
        old = ", ".join(f"{r} on {n}" for n, r in sorted(kept_prev))
        head = f"{len(ready_s)}/{req.replicas} replicas Ready at revision {s_rev}"
        if made_room:
            head += (f"; removed {', '.join(f'{r} on {n}' for n, r in made_room)} to make room "
                     f"for revision {s_rev}")
        if stalled:
            rollout = RolloutState("Stalled", f"{head}; revision {s_rev} failed on "
                                 f"{', '.join(stalled)}; still serving {old}",
                                 tuple(sorted(kept_prev)))
        elif blocked and not loading_s and not made_room:
            rollout = RolloutState("Blocked", f"{head}; no node has room for revision {s_rev} "
                                 f"next to the previous one ({dec_s.message or 'no room'}) and "
                                 f"maxUnavailable={max_unavailable} allows no replacement; "
                                 f"still serving {old}", tuple(sorted(kept_prev)))
        else:
            rollout = RolloutState("RollingUpdate",
                                 head + (f"; still serving {old}" if kept_prev else ""),
                                 tuple(sorted(kept_prev)))
    stuck_s = _stuck(moving_s, dec_s.message if dec_s.unplaced else "")
    return DeploymentPlan(desired=desired, stable=dataclasses.replace(
        dec_s, nodes=tuple(sorted(s_nodes)),
        unplaced=max(req.replicas - dec_s.waiting - len(s_nodes), 0),
        message=stuck_s or dec_s.message), candidate=dec_c, rollout=rollout, drain=drain)


def _handover(mine: Mapping[Slot, Assignment], revision: str, draining: Collection[str],
              replicas: int, ready_elsewhere: int, ready: Collection[Slot]) -> list[Slot]:
    """The slots of ``revision`` on draining nodes kept serving: Ready ones (a replica that does
    not serve is no capacity to keep), as many as the revision lacks Ready replicas elsewhere
    (``replicas - ready_elsewhere``), by node name."""
    drained = sorted(slot for slot in mine if slot[1] == revision and slot[0] in draining
                     and slot in ready)
    return drained[:max(replicas - ready_elsewhere, 0)]


def _stuck(moving: Sequence[Slot], unplaced_message: str) -> str:
    """Why drained replicas stay ("" when their replacement is placed, or none stays)."""
    if not moving or not unplaced_message:
        return ""
    where = ", ".join(f"{r} on {n}" for n, r in moving)
    return (f"{unplaced_message}; draining: {where} cannot move and keeps serving until a "
            f"replacement fits elsewhere")
