"""Whose word the operator takes: an agent's report, memory estimate or statistics count only
for a slot its node holds (plain data, no I/O; issue 19, docs/security.md, "Threat model").

An agent's etcd role lets it write anything under ``reports/<node>/`` and ``stats/<node>/``
(its own node's keys, :func:`mlx_fleet.etcd_security.plan_auth`), for any deployment. The
operator's followers index all of it (``Runtime.reports`` / ``Runtime.stats``, keyed by the
node in the *key*, which etcd's permissions make true — never by the record's own ``node``
field); the readers then keep only what these functions accept, so a rogue agent credential
cannot raise a deployment's per-replica memory (placement takes the largest estimate,
:func:`.placement.resolve_memory`), fake a replica's state, or trip a canary's guard and skew
its analysis for a deployment it does not serve.

The one source of "node N holds slot (N, revision) of deployment D" is D's stored assignments
(the fenced :class:`~.reconcile.FleetView`, or :attr:`.records.DeploymentRecord.placed`, its
last reconciled copy): ``placed`` below is a mapping slot → that slot's stored
:class:`~mlx_fleet.contract.Assignment`.

* :func:`held_reports`: the reports of held slots (any generation) — memory estimates and the
  status's per-node entries (which say "waiting for generation G" for an older one);
* :func:`current_report`: a held slot's report *for the stored assignment's generation* — the
  only one whose state (Ready, Failed, ...) describes the record as it is now;
* :func:`held_stats`: the statistics of nodes that hold at least one slot of the deployment
  (stable or candidate: a node serving the stable revision also counts the requests it
  forwards to the candidate during a canary).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TypeVar

from mlx_fleet.contract import Assignment, AssignmentReport

__all__ = ["held_reports", "current_report", "held_stats"]

Slot = tuple[str, str]  # (node, revision)
S = TypeVar("S")


def held_reports(reports: Mapping[Slot, AssignmentReport],
                 placed: Collection[Slot]) -> dict[Slot, AssignmentReport]:
    """The entries of ``reports`` ((node, revision) → report of one deployment) whose slot is
    in ``placed`` (the deployment's stored slots); the others — a node that holds no such
    assignment, or no longer does — are left out."""
    return {slot: r for slot, r in reports.items() if slot in placed}


def current_report(slot: Slot, reports: Mapping[Slot, AssignmentReport],
                   placed: Mapping[Slot, Assignment | None]) -> AssignmentReport | None:
    """``slot``'s report when ``slot`` is held (in ``placed``, with a parsed assignment) and
    the report is for that assignment's ``generation``; else None (not held, no report yet, or
    one describing an older record)."""
    r, a = reports.get(slot), placed.get(slot)
    if r is None or a is None or r.generation != a.generation:
        return None
    return r


def held_stats(stats: Mapping[str, S], placed: Collection[Slot]) -> dict[str, S]:
    """The entries of ``stats`` (node → that node's statistics of one deployment) of nodes
    holding at least one slot in ``placed`` (any revision)."""
    nodes = {node for node, _revision in placed}
    return {node: s for node, s in stats.items() if node in nodes}
