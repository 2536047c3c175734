"""The routing table: per served model name, the Ready replicas the router may send it to.

:func:`build` is a pure function of the fleet's records as the router's etcd views hold them
(node records, assignments, reports, traffic splits, stats reports; :mod:`mlx_fleet.contract`)
and the namespaces in scope → a :class:`Table`. The router rebuilds it when a view changes
(:mod:`~mlx_fleet_router.follow`) and reads it per request.

A replica — one revision of one deployment on one node — is **Ready** here when (the
operator's rule, ``mlx_fleet_operator.reconcile.report_slots``, one predicate:
:func:`mlx_fleet.routing.replicas.serves`):

* the operator assigned it (``assignments/<node>/<ns>/<name>/<revision>``);
* its agent's report for the same key is for the assignment's ``generation`` (an older report
  describes an older record) and says it serves (``Ready``, or standby: a request reloads it);
* its node record exists (the agent's lease is alive: a dead Mac's record goes with its lease).

Its ``endpoint`` is the report's, else the node record's ``address``. A node whose record says
``Draining`` marks its replicas ``cordoned``: the picker sends them no new request. Its
``capabilities`` are the report's (:class:`mlx_fleet.capabilities.ModelCapabilities`; None when
unknown): :meth:`Served.missing` tells when no replica can serve what a request needs (the
router's 400), and the picker skips the replicas that lack it.

**Scope** (``namespaces``; None: every namespace): deployments outside it are ignored.

**Served-name conflict**: two deployments (``namespace/name``) in scope whose assignments name
one ``served_model_name`` would mix two models under one name; the name is then *refused*
(:attr:`Table.conflicts`, the deployments claiming it) and has no entry in
:attr:`Table.models`, so no request is sent to either. A deployment counts as claiming a name as
soon as any of its assignments names it, Ready or not. The rule is
:func:`mlx_fleet.routing.names.conflicts`, the one the operator's ``ServedNameConflict``
condition uses.

Pure: :mod:`mlx_fleet.contract`, :mod:`mlx_fleet.capabilities`, :mod:`mlx_fleet.routing.names`
and :mod:`mlx_fleet.routing.replicas` only.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from mlx_fleet.capabilities import (TASK_TEXT_GENERATION, Missing, ModelCapabilities, Need,
                                    Task, missing_everywhere)
from mlx_fleet.contract import (Assignment, AssignmentReport, NodeHealth, NodeRecord,
                                StatsReport, TrafficSplit)
from mlx_fleet.routing import names
from mlx_fleet.routing.replicas import serves

__all__ = ["Replica", "Served", "Table", "build", "AssignmentKey", "SplitKey", "StatsKey"]

#: ``(node, namespace, name, revision)``: the key of an assignment and of its report
#: (:meth:`mlx_fleet.contract.Keys.parse_assignment`).
AssignmentKey = tuple[str, str, str, str]
#: ``(namespace, name)``: the key of a traffic split.
SplitKey = tuple[str, str]
#: ``(node, namespace, name)``: the key of a stats report.
StatsKey = tuple[str, str, str]


@dataclass(frozen=True, slots=True)
class Replica:
    """One Ready replica: the Mac (``node``, its identity on the hash ring), the ``revision``
    it serves, its ``endpoint`` (base URL), ``cordoned`` (its node is draining: no new
    requests), ``batch_limit`` (the assignment's ``serving.max_concurrent_sequences``) and
    ``capabilities`` (its report's; None: unknown, an agent older than them or a revision not
    loaded yet); ``task``: its assignment's (what even an unknown replica is known to serve)."""

    node: str
    revision: str
    endpoint: str
    cordoned: bool = False
    batch_limit: int = 1
    capabilities: ModelCapabilities | None = None
    task: Task = TASK_TEXT_GENERATION


@dataclass(frozen=True, slots=True)
class Served:
    """One served model name in scope: its ``deployment`` (``"namespace/name"``), its Ready
    ``replicas`` (sorted by node, then revision; possibly empty), the deployment's traffic
    ``split`` (None when no canary runs) and ``guard_tripped`` (an agent reported the local
    guard of this split tripped: every request goes stable)."""

    model: str
    deployment: str
    replicas: tuple[Replica, ...] = ()
    split: TrafficSplit | None = None
    guard_tripped: bool = False

    @property
    def revisions(self) -> tuple[str, ...]:
        """The revisions with a Ready replica, sorted, each once."""
        return tuple(sorted({r.revision for r in self.replicas}))

    def missing(self, needs: Iterable[Need]) -> Missing | None:
        """What no replica of this model serves of ``needs``
        (:func:`mlx_fleet.capabilities.missing_everywhere` over every replica, cordoned ones
        too: a capability does not come back when a drain ends, availability is the picker's
        concern), or None: some replica may serve the request (or there is none: 503)."""
        return missing_everywhere((r.task if r.capabilities is None else r.capabilities
                                   for r in self.replicas), needs)


@dataclass(frozen=True, slots=True)
class Table:
    """``models``: served name → :class:`Served`; ``conflicts``: refused served name → the
    deployments (``"namespace/name"``, sorted) claiming it."""

    models: Mapping[str, Served] = field(default_factory=dict)
    conflicts: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


def build(*, nodes: Mapping[str, NodeRecord],
          assignments: Mapping[AssignmentKey, Assignment],
          reports: Mapping[AssignmentKey, AssignmentReport],
          splits: Mapping[SplitKey, TrafficSplit] | None = None,
          stats: Mapping[StatsKey, StatsReport] | None = None,
          namespaces: Collection[str] | None = None) -> Table:
    """The routing table of these records (module docstring). ``namespaces``: the scope (None:
    all). Never raises for any combination of records."""
    splits = splits or {}
    stats = stats or {}
    claims: list[tuple[str, str]] = []  # (served name, "namespace/name"), one per assignment
    ready: dict[str, list[Replica]] = {}
    for key, a in assignments.items():
        node, ns, name, revision = key
        if namespaces is not None and ns not in namespaces:
            continue
        deployment = f"{ns}/{name}"
        claims.append((a.served_model_name, deployment))
        ready.setdefault(deployment, [])
        r = reports.get(key)
        rec = nodes.get(node)
        if r is None or rec is None or r.generation != a.generation \
                or not serves(r.state.value, r.reason):
            continue
        endpoint = (r.endpoint or rec.address).rstrip("/")
        if not endpoint:
            continue
        ready[deployment].append(Replica(
            node=node, revision=revision, endpoint=endpoint,
            cordoned=rec.health == NodeHealth.DRAINING,
            batch_limit=a.serving.max_concurrent_sequences, capabilities=r.capabilities,
            task=a.task))
    tripped = {(ns, name, s.canary_uid) for (_, ns, name), s in stats.items()
               if s.guard_tripped}
    conflicts = names.conflicts(claims)
    models: dict[str, Served] = {}
    for model, deployment in dict(claims).items():
        if model in conflicts:
            continue
        ns, name = deployment.split("/", 1)
        split = splits.get((ns, name))
        models[model] = Served(
            model=model, deployment=deployment,
            replicas=tuple(sorted(ready[deployment], key=lambda r: (r.node, r.revision))),
            split=split,
            guard_tripped=split is not None and (ns, name, split.canary_uid) in tripped)
    return Table(models=models, conflicts=conflicts)
