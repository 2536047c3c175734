"""Placement: which Macs serve a ModelDeployment. A pure function over plain data.

:func:`place` takes what the operator read (the request, every node record, every current
assignment of every deployment) and returns the nodes that should host the deployment's
replicas, and — like the kube-scheduler's ``FailedScheduling`` event — a human explanation of
why the remaining replicas could not be placed. It does no I/O and keeps no state, so the
same input always gives the same output (ties are broken by node name).

Rules
-----
* A request places one **revision** of a deployment: a served model's identity is
  (deployment, revision), so a rolling update's surge or a canary's candidate is a second
  request for the same deployment.
* A node is *eligible* when it is ``Healthy``, carries every ``nodeSelector`` label, has
  ``chip_generation >= minChipGeneration``, serves the deployment's task (:func:`serves_task`:
  the agent's ``NodeRecord.tasks``; a record of an agent older than the field serves
  ``TextGeneration`` only, so a ``TextEmbedding`` deployment skips it), hosts no assignment of *another* deployment with
  the same served model name (one agent serves each OpenAI ``model`` id for one deployment;
  a second one would fail there with ``ModelNameConflict`` forever), its memory budget
  fits and it is below its limit on loaded models (``NodeCapacity.max_loaded_models``, the
  agent's ``--max-loaded-models``, seed 004; 0 = no limit): the node's *other* assignments —
  other deployments and other revisions of this one, both sides of a canary — must number
  fewer than the limit, so the revision placed is at most the limit-th; and, for a *new*
  replica, is not cordoned (``MacNode`` ``spec.unschedulable``; a replica
  already there stays, like a cordoned Kubernetes node keeps its pods) and not *draining*
  (``MacNode`` ``spec.drain``: its replicas are replicas to replace — they are left out of the
  decision and placed elsewhere; :mod:`.rollout` keeps the drained one serving until its
  replacement is Ready). The budget is
  ``memory_total_bytes × memory_watermark`` (the node's own, reported by its agent; default
  80 %, seed 004), capped by the GPU wired limit, minus the ``memory_bytes`` of every
  other assignment on that node — other deployments *and other revisions of this one* (both
  sides of a canary, or of a surge, are resident at once); only the revision being placed does
  not count against itself.
* What an agent says of itself is believed only within bounds (:mod:`.node_claims`, issue 19):
  a ``nodeSelector`` label is the MacNode's (``PlacementRequest.node_labels``, set by the
  cluster admin) or, under ``agent.mlx-fleet.io/``, the agent's; the memory counted is at most
  what the named chip can have, the generation at most what its name says.
* Stability: a replica already placed on a node that is still eligible stays there; it is never
  moved just because another node has more room. Replicas on vanished or ineligible nodes are
  dropped (and re-placed elsewhere if possible).
* Scale down removes replicas from the most loaded nodes first (least free budget; ties: the
  node name sorting last goes first).
* Scale up adds replicas on ``preferred`` nodes first (a new revision next to the old one, a
  candidate next to the stable), then by strategy: ``Spread`` = most free budget first,
  ``Binpack`` = least free budget that still fits; ties by node name. At most one replica of a
  revision per node.

Memory per replica (:func:`resolve_memory`)
-------------------------------------------
``spec.resources.memory``, when set, is the user's override and wins. When unset, a replica
needs the **largest estimate any agent reported** for the revision (``AssignmentReport.
estimated_bytes``: weights from the safetensors headers plus the KV cache at the assignment's
serving limits, :mod:`node_agent.memory_estimate`; the largest, so a node that computed a
bigger KV cache is believed; only agents whose node holds an assignment of the revision are
asked — :func:`.holders.held_reports` — so another Mac's agent credential cannot inflate it).
Before any estimate exists (``estimate_pending``), one replica is
placed — on the node with the most free budget, whatever the strategy — and the others wait
(``PlacementDecision.waiting``) for its agent's estimate; replicas already placed stay. An agent
report that carries an estimate counts whatever its state, so a load refused or failed for lack
of memory re-places the revision with that estimate: a node whose free budget is below it is no
longer eligible, and its replica moves.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, Literal

from mlx_fleet.capabilities import TASK_TEXT_GENERATION, Task
from mlx_fleet.contract import (MIN_CHIP_GENERATION, Assignment, AssignmentReport, NodeHealth,
                                NodeRecord)
from mlx_fleet.contract import node_budget_bytes as contract_budget
from mlx_fleet.quantity import format_bytes

from .holders import held_reports
from .node_claims import node_label, trusted_generation, trusted_memory_bytes


Strategy = Literal["Spread", "Binpack"]


@dataclasses.dataclass(frozen=True)
class PlacementRequest:
    """What one ModelDeployment asks for.

    ``memory_bytes``: unified memory per replica (bytes, > 0). ``node_selector``: labels a node
    must all carry. ``min_chip_generation``: 3 for M3 ... ``strategy``: Spread or Binpack.
    ``served_model_name``: the OpenAI ``model`` id; empty means ``name`` (as in the spec).
    ``revision``: the revision placed. ``preferred``: nodes tried first when adding replicas.
    ``cordoned``: nodes that take no new replica (their existing replicas stay).
    ``draining``: nodes being drained: they take no new replica and their replicas are placed
    elsewhere (left out of ``nodes``; the caller keeps them until the replacement serves).
    ``estimate_pending``: no memory figure yet (no override, no estimate; ``memory_bytes`` is
    then 0): at most one replica is added, on the node with most free budget (module docstring).
    ``node_labels``: node name → its MacNode's ``metadata.labels`` (set by the cluster admin;
    :func:`.node_claims.node_label`). ``task``: the deployment's ``spec.model.task``.
    """

    namespace: str
    name: str
    replicas: int
    memory_bytes: int
    revision: str = ""
    node_selector: Mapping[str, str] = dataclasses.field(default_factory=dict)
    min_chip_generation: int = MIN_CHIP_GENERATION
    strategy: Strategy = "Spread"
    served_model_name: str = ""
    preferred: frozenset[str] = frozenset()
    cordoned: frozenset[str] = frozenset()
    draining: frozenset[str] = frozenset()
    estimate_pending: bool = False
    node_labels: Mapping[str, Mapping[str, str]] = dataclasses.field(default_factory=dict)
    task: Task = TASK_TEXT_GENERATION

    @property
    def model_name(self) -> str:
        """The served model name in effect (``served_model_name`` or ``name``)."""
        return self.served_model_name or self.name


@dataclasses.dataclass(frozen=True)
class PlacementDecision:
    """The outcome of :func:`place`.

    ``nodes``: the nodes that should host a replica, sorted by name. ``kept``/``added``/
    ``removed``: the diff against the current placement (``removed`` includes nodes that
    vanished). ``unplaced``: replicas that could not be placed. ``waiting``: replicas held
    back until the revision's memory estimate exists (not a failure). ``reasons``: one fragment per
    cause, e.g. ``"2 below chip generation M4"`` or ``"2 at their model limit (mac-a 2 of 2
    models, mac-b 3 of 3 models)"``; ``message``: the whole sentence, e.g.
    ``"0/3 nodes fit: 2 below chip generation M4, 1 insufficient memory (needs 2.0GiB: mac-a
    1.1GiB free of 6.4GiB)"`` (per node, most free first, at most five named); both empty when
    every replica is placed.
    """

    nodes: tuple[str, ...]
    kept: tuple[str, ...] = ()
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    unplaced: int = 0
    reasons: tuple[str, ...] = ()
    message: str = ""
    waiting: int = 0


def resolve_memory(override: int | None, estimates: Iterable[int]) -> int | None:
    """Bytes one replica needs (module docstring): ``override`` (``spec.resources.memory``)
    when set, else the largest positive estimate, else None (no figure yet)."""
    if override:
        return override
    return max((e for e in estimates if e > 0), default=None)


def revision_estimates(reports: Mapping[tuple[str, str], AssignmentReport],
                       placed: Collection[tuple[str, str]]) -> dict[str, int]:
    """Revision → the largest ``estimated_bytes`` in one deployment's reports ((node, revision)
    → report, any state; revisions with no estimate are absent), counting only the reports of
    slots in ``placed`` — the deployment's stored (node, revision) slots
    (:func:`.holders.held_reports`: another node's agent credential may write a report for
    it)."""
    out: dict[str, int] = {}
    for (_node, revision), r in held_reports(reports, placed).items():
        if r.estimated_bytes > 0:
            out[revision] = max(out.get(revision, 0), r.estimated_bytes)
    return out


def node_budget_bytes(node: NodeRecord) -> int:
    """Bytes assignments may reserve on ``node``: its capacity's
    :meth:`~mlx_fleet.contract.NodeCapacity.budget_bytes` — ``memory_total_bytes ×
    memory_watermark`` (the agent's ``--memory-watermark``; 80 % by default and for records
    without the field), floored, capped by the GPU wired-memory limit when the node reports one
    (the same rule the agent uses; computed once per distinct machine size and watermark) —
    of the memory placement believes (:func:`.node_claims.trusted_memory_bytes`: at most what
    the chip can have)."""
    c = node.capacity
    return _budget(trusted_memory_bytes(c), c.wired_limit_bytes, c.memory_watermark)


#: The contract's budget rule (exact decimal arithmetic) per distinct (total, wired limit,
#: watermark): a fleet has few distinct machine sizes, and placement asks once per node per
#: reconcile.
_budget = functools.lru_cache(maxsize=1024)(contract_budget)


def is_mine(request: PlacementRequest, a: Assignment) -> bool:
    """True when ``a`` is the assignment of the very revision ``request`` places."""
    return (a.name == request.name and a.namespace == request.namespace
            and a.source.revision == request.revision)


def used_by_others(request: PlacementRequest, assignments: Sequence[Assignment]) -> int:
    """Memory reserved on one node by every assignment but the revision ``request`` places
    (other deployments and other revisions of the same deployment)."""
    total = 0
    for a in assignments:  # (a loop, not sum() over a generator: called per node per reconcile)
        if not is_mine(request, a):
            total += a.memory_bytes
    return total


def free_bytes(request: PlacementRequest, node: NodeRecord,
               assignments: Sequence[Assignment]) -> int:
    """The node's budget left for ``request`` (may be negative when it is over-committed)."""
    return node_budget_bytes(node) - used_by_others(request, assignments)


def _fmt(n: int) -> str:
    return format_bytes(max(n, 0))


def serves_name_of_another(request: PlacementRequest, assignments: Sequence[Assignment]) -> bool:
    """True when one node's ``assignments`` include another deployment serving the same model
    name as ``request``."""
    model_name = request.model_name
    for a in assignments:
        if a.served_model_name == model_name and (a.name != request.name
                                                  or a.namespace != request.namespace):
            return True
    return False


#: Nodes named (with their numbers) in an insufficient-memory reason; the rest are counted.
_MAX_NODES_NAMED = 5

def others_count(request: PlacementRequest, assignments: Sequence[Assignment]) -> int:
    """Revisions assigned to one node besides the one ``request`` places (each assignment is
    one revision of one deployment; both sides of a canary or of a surge count)."""
    return sum(1 for a in assignments if not is_mine(request, a))


def at_model_limit(request: PlacementRequest, node: NodeRecord,
                   assignments: Sequence[Assignment]) -> bool:
    """True when ``node`` has a limit on loaded models (``max_loaded_models`` > 0) and its
    other assignments already reach it, so ``request``'s revision would exceed it."""
    limit = node.capacity.max_loaded_models
    return limit > 0 and others_count(request, assignments) >= limit


_NO_LABELS: Mapping[str, str] = {}

# Order of the checks, which is also the order of the reasons in the message.
_UNHEALTHY, _SELECTOR, _CHIP, _TASK, _NAME, _MEMORY, _MODEL_LIMIT, _DRAINING, _CORDONED = range(9)


def serves_task(node: NodeRecord, task: Task) -> bool:
    """Whether ``node``'s agent serves models of ``task`` (its record's ``tasks``: an agent
    older than the field wrote none and reads as ``TextGeneration`` only)."""
    return task in node.tasks


def _ineligible(request: PlacementRequest, node: NodeRecord, free: int,
                assignments: Sequence[Assignment]) -> int | None:
    if node.health != NodeHealth.HEALTHY:
        return _UNHEALTHY
    if request.node_selector:
        operator_labels = request.node_labels.get(node.name, _NO_LABELS)
        if any(node_label(node, k, operator_labels) != v
               for k, v in request.node_selector.items()):
            return _SELECTOR
    if trusted_generation(node.capacity) < request.min_chip_generation:
        return _CHIP
    if not serves_task(node, request.task):
        return _TASK
    if assignments and serves_name_of_another(request, assignments):
        return _NAME
    if free < request.memory_bytes:
        return _MEMORY
    if at_model_limit(request, node, assignments):
        return _MODEL_LIMIT
    if node.name in request.draining:  # its replicas are moved elsewhere
        return _DRAINING
    if node.name in request.cordoned:  # otherwise fit: may keep a replica, takes no new one
        return _CORDONED
    return None


def place(request: PlacementRequest, nodes: Sequence[NodeRecord],
          assignments: Mapping[str, Sequence[Assignment]],
          held: frozenset[str] = frozenset()) -> PlacementDecision:
    """Choose the nodes for ``request``'s replicas (rules in the module docstring).

    ``nodes``: every node record. ``assignments``: node name → all assignments stored for that
    node (every deployment, including ``request``'s own; nodes without a record may appear).
    ``held``: vanished nodes whose replicas are kept where they are, neither moved nor given
    new ones (a control-plane disruption, :mod:`.disruption`). Raises ``ValueError`` if two
    records share a name or ``replicas`` is negative.
    """
    if request.replicas < 0:
        raise ValueError(f"replicas must be >= 0, got {request.replicas}")
    by_name: dict[str, NodeRecord] = {}
    for n in nodes:
        if n.name in by_name:
            raise ValueError(f"duplicate node record {n.name!r}")
        by_name[n.name] = n
    current = sorted(node for node, items in assignments.items()
                     if any(is_mine(request, a) for a in items))

    free: dict[str, int] = {}
    verdict: dict[str, int | None] = {}
    for name, n in by_name.items():
        items = assignments.get(name, ())
        # free_bytes(), with the sum skipped for the (many) nodes that hold nothing
        free[name] = f = (node_budget_bytes(n) - used_by_others(request, items) if items
                          else node_budget_bytes(n))
        verdict[name] = _ineligible(request, n, f, items)
    eligible = {name for name, v in verdict.items() if v is None}

    kept = [n for n in current
            if n in eligible or verdict.get(n) == _CORDONED or (n in held and n not in by_name)]
    # Scale down: drop from the most loaded nodes first (least free; ties: last name first).
    if len(kept) > request.replicas:
        kept.sort(key=lambda n: (free.get(n, 0), _neg(n)))
        kept = kept[len(kept) - request.replicas:] if request.replicas else []
    chosen = set(kept)

    candidates = [n for n in eligible if n not in chosen]
    wanted = request.replicas
    if request.estimate_pending:  # one replica first, where most memory is free
        wanted = min(request.replicas, max(len(chosen), 1))
        order: Any = lambda n: (-free[n], n)  # noqa: E731
    elif request.strategy == "Binpack":
        order = lambda n: (n not in request.preferred, free[n], n)  # noqa: E731
    else:
        order = lambda n: (n not in request.preferred, -free[n], n)  # noqa: E731
    # the first few in that order (keys are unique: the same as sorting and slicing)
    added = heapq.nsmallest(max(wanted - len(chosen), 0), candidates, key=order)
    chosen.update(added)
    waiting = request.replicas - wanted
    unplaced = wanted - len(chosen)

    reasons: tuple[str, ...] = ()
    message = ""
    if unplaced > 0:
        others = {name: others_count(request, assignments.get(name, ())) for name in by_name}
        reasons, message = _explain(request, by_name, verdict, free, others, unplaced)
    return PlacementDecision(
        nodes=tuple(sorted(chosen)), kept=tuple(sorted(kept)), added=tuple(sorted(added)),
        removed=tuple(n for n in current if n not in chosen), unplaced=unplaced,
        reasons=reasons, message=message, waiting=waiting)


class _neg(str):
    """Sort key that orders strings in reverse."""

    def __lt__(self, other: str) -> bool:  # type: ignore[override]
        return str.__gt__(self, other)

    def __gt__(self, other: str) -> bool:  # type: ignore[override]
        return str.__lt__(self, other)


def _explain(request: PlacementRequest, by_name: Mapping[str, NodeRecord],
             verdict: Mapping[str, int | None], free: Mapping[str, int],
             others: Mapping[str, int], unplaced: int) -> tuple[tuple[str, ...], str]:
    total = len(by_name)
    replicas = "replica" if unplaced == 1 else "replicas"
    if total == 0:
        return ("no nodes registered",), f"{unplaced} {replicas} unplaced: no nodes registered"
    counts: dict[int, list[str]] = {}
    for name in sorted(by_name):
        v = verdict[name]
        if v is not None:
            counts.setdefault(v, []).append(name)
    fit = sum(1 for v in verdict.values() if v is None)
    parts: list[str] = []
    for kind in sorted(counts):
        names = counts[kind]
        k = len(names)
        if kind == _UNHEALTHY:
            states = sorted({by_name[n].health.value for n in names})
            parts.append(f"{k} not healthy ({', '.join(states)})")
        elif kind == _SELECTOR:
            sel = ",".join(f"{a}={b}" for a, b in sorted(request.node_selector.items()))
            parts.append(f"{k} not matching node selector {sel}")
        elif kind == _CHIP:
            parts.append(f"{k} below chip generation M{request.min_chip_generation}")
        elif kind == _TASK:
            verb = "serves" if k == 1 else "serve"
            parts.append(f"{k} {verb} no {request.task} models (agent too old)")
        elif kind == _NAME:
            verb = "serves" if k == 1 else "serve"
            parts.append(f"{k} already {verb} model name {request.model_name!r}")
        elif kind == _DRAINING:
            parts.append(f"{k} draining")
        elif kind == _CORDONED:
            parts.append(f"{k} cordoned")
        elif kind == _MEMORY:
            # the numbers per node (needed vs free of the budget), most free first
            shown = sorted(names, key=lambda n: (-free[n], n))[:_MAX_NODES_NAMED]
            per = ", ".join(f"{n} {_fmt(free[n])} free of {_fmt(node_budget_bytes(by_name[n]))}"
                            for n in shown)
            more = f", {k - len(shown)} more" if k > len(shown) else ""
            parts.append(f"{k} insufficient memory (needs {_fmt(request.memory_bytes)}: "
                         f"{per}{more})")
        elif kind == _MODEL_LIMIT:
            # the numbers per node: revisions assigned of its limit (names in order)
            shown = names[:_MAX_NODES_NAMED]
            per = ", ".join(f"{n} {others[n]} of {by_name[n].capacity.max_loaded_models} "
                            "models" for n in shown)
            more = f", {k - len(shown)} more" if k > len(shown) else ""
            parts.append(f"{k} at {'its' if k == 1 else 'their'} model limit ({per}{more})")
    message = f"{fit}/{total} nodes fit: {', '.join(parts)}"
    if fit:  # the fitting nodes already host one replica each
        message += f"; {unplaced} of {request.replicas} replicas unplaced (one per node)"
    return tuple(parts), message


def affected_by_node(node: str, placed: Mapping[Any, Iterable[tuple[str, str]]],
                     unsettled: Iterable[Any]) -> set[Any]:
    """The deployments a change of ``node`` (appeared, gone, health, labels, capacity) can
    make placement decide differently for. Pure.

    ``placed``: deployment → its (node, revision) slots as last reconciled; ``unsettled``: the
    deployments whose last reconcile left something open (replicas unplaced or waiting for an
    estimate, a rollout or canary candidate not complete). A deployment with a replica on the
    node must look again (the node may be gone or no longer fit); one that is not fully placed
    may now fit on it. A fully placed deployment elsewhere keeps its assignments whatever the
    node does (placement never moves a fitting replica), so it is not woken — with a thousand
    Macs, a Mac joining or leaving touches only the deployments it concerns."""
    out = {key for key, slots in placed.items() if any(n == node for n, _ in slots)}
    return out | set(unsettled)
