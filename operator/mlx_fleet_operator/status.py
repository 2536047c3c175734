"""The ModelDeployment ``status`` and the Kubernetes events to post: a pure function.

:func:`compute_status` turns what the operator knows (the spec's generation and replica count,
the placement decision, the assignments it wrote, the agents' reports and node records, and the
previous status) into the new ``status`` dict (docs/modeldeployment-api.md) and the list of events
that mark transitions since the previous status. Conditions follow the Kubernetes API
conventions (metav1.Condition): ``type``, ``status`` ("True"/"False"/"Unknown"), CamelCase
``reason``, ``message``, ``lastTransitionTime`` (kept unchanged while ``status`` does not change)
— all five always set, the CRD requires them — and ``observedGeneration``.

``status.nodes`` has one entry per (node, revision) assignment, with its ``revision`` and
``role`` (Stable, Previous while a revision edit rolls out, Candidate under a Canary).
``status.replicas`` is *observed*: the nodes holding a Stable or Previous assignment, in any
state; ``readyReplicas``: the nodes where one of them is Ready (a node serves once, whichever
revision); ``updatedReplicas``: the nodes where the Stable revision (``spec.model.revision``) is
Ready. ``endpoints``: every node with a Ready Stable or Previous revision — so a revision edit
never empties it. Candidate replicas are listed but belong to the Canary's status: they never
change the ModelDeployment's conditions.

Idle-unloaded replicas (standby)
--------------------------------
A replica with no request for ``spec.lifecycle.idleUnloadSeconds`` is unloaded by its agent
and reported ``Unloaded`` with reason ``IdleUnloaded`` (``freedBytes`` in the agent's report);
while a request reloads it, ``Loading`` with reason ``ReloadingOnDemand``
(:func:`mlx_fleet.contract.is_standby`). It stays assigned and its agent answers requests for
it (the first one waits for the reload), so a standby replica is *not* a failure and *not*
starting: it counts as serving — in ``readyReplicas``, ``updatedReplicas`` and ``endpoints``
— and never flips ``Ready`` to False or ``Progressing`` to True. It is listed in
``status.nodes`` with its real state and reason (``Unloaded``/``IdleUnloaded``). Any other
``Unloaded`` replica is not serving.

Conditions
----------
``Ready``        True when ``readyReplicas >= replicas`` (``ScaledToZero`` when replicas is 0);
                 standby replicas count as ready.
``Progressing``  True while placed replicas are still being fetched or loaded
                 (``ReplicasStarting``) or a revision edit is rolling out (``RollingUpdate``);
                 False with ``Complete``, ``RolloutStalled`` (the new revision failed; the
                 previous one keeps serving), ``RolloutBlocked``, ``FailedPlacement`` or
                 ``ReplicaFailed`` otherwise.
``Degraded``     True when a replica failed or replicas could not be placed.
``Scheduled``    True (``Scheduled``) when every replica is placed; False with ``Unschedulable``
                 and placement's explanation — needed vs free memory per candidate node, like
                 the kube-scheduler's ``FailedScheduling`` — while some cannot be (also while a
                 drained replica cannot move: it keeps serving where it is); False with
                 ``AwaitingEstimate`` while replicas wait for the agents' memory estimate
                 (``spec.resources.memory`` unset: one replica is placed first); False with
                 ``InvalidSpec`` for an invalid spec.
``ServedNameConflict``  True (``NameClaimedByAnother``, naming the others) while another
                 ModelDeployment in the operator's scope claims one of its served model names
                 (:mod:`mlx_fleet.routing.names`: the fleet router refuses such a name);
                 False (``NoConflict``) otherwise. A Warning event ``ServedNameConflict`` when
                 it turns True (or the rivals change), Normal ``ServedNameConflictResolved``
                 when it clears.

``SourceAllowed``  True (``SourceAllowed``) when the fleet's source policy (the operator's
                 ``--source-policy``, :mod:`.admission`) allows ``spec.model.source``; False
                 (``SourceRefused``, "spec.model.source: refused by the source policy: <rule>")
                 otherwise: nothing is (re)placed — what was placed for the last admitted spec
                 stays, as for an invalid spec — and ``Ready``/``Progressing``/``Degraded``/
                 ``Scheduled`` carry reason ``SourceRefused``; a Warning event
                 ``SourceRefused`` when it turns False.

``ReplicasConsistent``  False (``DigestMismatch``, naming each revision's Macs per digest)
                 while replicas of one revision report different content digests (the agent's
                 ``digest``: a mirror's ``sha256:`` manifest digest or a hub commit; listed per
                 replica in ``status.nodes[].digest``): they hold different bytes under one
                 revision label. True (``DigestsMatch``) when every revision's reporting
                 replicas agree; Unknown (``NoDigests``) while none reports one (local
                 ``file://`` sources are not content-addressed). A Warning event
                 ``DigestMismatch`` when it turns False (or the split changes)
                 (:func:`digest_consistency`).

``status.router`` (``{url, model}``): the URL and model id a client should use — the fleet
router's (the operator's ``--router-url``) and the served model name; absent without a router.

Drained replicas
----------------
A replica on a draining Mac (``MacNode`` ``spec.drain``) keeps serving, and counts like any
other, until its replacement is Ready elsewhere. Then it is *withdrawn* (``withdrawn``): listed
in ``nodes`` with reason ``Withdrawn`` but no longer counted in ``replicas``/``readyReplicas``
nor listed in ``endpoints`` — clients following ``endpoints`` stop sending to it — and its
assignment is removed once that status is published (the agent lets running requests finish).

A report counts only when its ``generation`` equals the generation of the assignment stored
for that node (an older report describes an older spec).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterable, Mapping
from typing import Any

from mlx_fleet.contract import (AWAITING_REQUEST, EVICTED, IDLE_UNLOADED, Assignment,
                                AssignmentReport, AssignmentState, NodeRecord, Role, is_standby)
from mlx_fleet.routing import replicas

Slot = tuple[str, str]  # (node, revision)

CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "Scheduled", "ServedNameConflict",
                   "SourceAllowed", "ReplicasConsistent")


@dataclasses.dataclass(frozen=True)
class Event:
    """A Kubernetes event to post on the ModelDeployment: ``type`` Normal or Warning."""

    type: str
    reason: str
    message: str


@dataclasses.dataclass(frozen=True)
class StatusInput:
    """Everything :func:`compute_status` looks at.

    ``assignments``: (node, revision) → this deployment's stored assignments (after reconcile).
    ``reports``: (node, revision) → the agent's report. ``nodes``: node → record.
    ``unplaced`` / ``placement_message``: from the stable revision's placement decision.
    ``rollout_reason`` / ``rollout_message``: :class:`~.rollout.RolloutState` of a revision
    edit (``Complete`` when none is rolling out).
    ``spec_error``: set when the spec is invalid (nothing is re-placed then; ``assignments``
    are those still stored from the last valid spec, still served, so still reported).
    ``withdrawn``: drained slots replaced elsewhere, on their way out (module docstring).
    ``waiting``: replicas held back until the revision's memory estimate exists.
    ``served_name``: the model id clients send (:meth:`~.spec.DeploymentSpec.served_name`;
    "" when the spec is invalid). ``rivals``: each served name of this deployment that another
    ModelDeployment in the operator's scope claims too → those deployments
    (``"namespace/name"``, sorted; :func:`mlx_fleet.routing.names.rivals`).
    ``router_url``: the fleet router's base URL clients use (the operator's ``--router-url``;
    None: no router configured). ``source_refused``: set when the source policy refuses the
    spec's source (:func:`.admission.source_refusal`'s message; nothing is re-placed then,
    like ``spec_error``).
    """

    generation: int
    replicas: int
    assignments: Mapping[Slot, Assignment] = dataclasses.field(default_factory=dict)
    reports: Mapping[Slot, AssignmentReport] = dataclasses.field(default_factory=dict)
    nodes: Mapping[str, NodeRecord] = dataclasses.field(default_factory=dict)
    unplaced: int = 0
    placement_message: str = ""
    spec_error: str | None = None
    revision: str = ""
    rollout_reason: str = "Complete"
    rollout_message: str = ""
    withdrawn: frozenset[Slot] = frozenset()
    waiting: int = 0
    served_name: str = ""
    rivals: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    router_url: str | None = None
    source_refused: str | None = None


def now_rfc3339(now: dt.datetime | None = None) -> str:
    """UTC time as RFC 3339 with second precision (``2025-01-02T03:04:05Z``)."""
    now = now or dt.datetime.now(dt.timezone.utc)
    return now.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _node_entry(node: str, asg: Assignment, report: AssignmentReport | None,
                record: NodeRecord | None) -> dict[str, Any]:
    endpoint = (report.endpoint if report and report.endpoint else
                record.address if record else "")
    base = {"name": node, "revision": asg.revision, "role": asg.role.value}
    if report is None:
        return base | {"state": AssignmentState.PENDING.value, "reason": "AwaitingAgent",
                       "message": f"waiting for the agent to report generation {asg.generation}",
                       "endpoint": endpoint}
    if report.generation != asg.generation:
        return base | {"state": AssignmentState.PENDING.value, "reason": "AwaitingAgent",
                       "message": (f"agent last reported {report.state.value} for generation "
                                   f"{report.generation}; assigned generation is "
                                   f"{asg.generation}"),
                       "endpoint": endpoint}
    entry = base | {"state": report.state.value, "reason": report.reason or report.state.value,
                    "message": report.message, "endpoint": endpoint}
    if report.digest:
        entry["digest"] = report.digest
    if report.state == AssignmentState.PREFETCHING and report.progress is not None:
        p = report.progress
        entry["download"] = {"bytesDone": p.bytes_done, "bytesTotal": p.bytes_total,
                             "bytesPerSecond": int(p.rate_bytes_per_second), "text": p.text()}
        if p.eta_seconds is not None:
            entry["download"]["etaSeconds"] = int(round(p.eta_seconds))
    return entry


def condition(ctype: str, status: str, reason: str, message: str, generation: int,
              previous: Mapping[str, Mapping[str, Any]], now: str) -> dict[str, Any]:
    """One condition with every field metav1.Condition (and the CRD) requires: ``type``,
    ``status``, ``lastTransitionTime``, a non-empty ``reason`` and a ``message`` (a string,
    at most 32768 characters)."""
    message = (message or "")[:32768]
    prev = previous.get(ctype)
    changed = prev is None or prev.get("status") != status
    return {"type": ctype, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": now if changed else prev.get("lastTransitionTime", now),
            "observedGeneration": generation}


_condition = condition  # the name other modules import


#: Standby report reason → (what the event says happened, event reason).
_STANDBY_EVENTS = {
    IDLE_UNLOADED: ("was unloaded while idle", "ReplicaIdleUnloaded"),
    EVICTED: ("was evicted to make room for another model's load", "ReplicaEvicted"),
    AWAITING_REQUEST: ("is not loaded until a request asks for it (prefetch OnDemand)",
                       "ReplicaAwaitingRequest"),
}


def compute_status(inp: StatusInput, previous: Mapping[str, Any] | None = None,
                   now: dt.datetime | None = None) -> tuple[dict[str, Any], list[Event]]:
    """→ ``(status, events)``. ``previous``: the object's current ``status`` (or None).

    Events (only on transitions against ``previous``): Normal ``Placed`` for a node that newly
    hosts a replica, Normal ``ReplicaReady`` when a replica becomes Ready, Warning
    ``ReplicaFailed`` with the agent's reason and message when one becomes Failed (or fails
    with a new reason), Warning ``FailedPlacement`` when replicas become unplaceable or the
    explanation changes, Warning ``InvalidSpec`` when the spec becomes invalid, Warning
    ``RolloutStalled`` / ``RolloutBlocked`` when Progressing turns to that reason, Normal
    ``RolloutComplete`` when the last Previous replica of a rollout is gone, Normal
    ``ReplicaIdleUnloaded`` / ``ReplicaEvicted`` / ``ReplicaAwaitingRequest`` when a replica
    goes to standby (unloaded for idleness, evicted for another load's memory, not loaded
    until a request asks: :data:`_STANDBY_EVENTS`) and Normal
    ``ReplicaReloaded`` (instead of ``ReplicaReady``) when a standby replica is Ready again.
    """
    previous = previous or {}
    stamp = now_rfc3339(now)
    prev_conditions = {c.get("type"): c for c in previous.get("conditions") or [] if isinstance(c, Mapping)}
    prev_nodes = {(n.get("name"), n.get("revision", "")): n for n in previous.get("nodes") or []
                  if isinstance(n, Mapping)}
    gen = inp.generation
    events: list[Event] = []

    entries = [_node_entry(slot[0], inp.assignments[slot], inp.reports.get(slot),
                           inp.nodes.get(slot[0])) for slot in sorted(inp.assignments)]
    for e in entries:
        if (e["name"], e["revision"]) in inp.withdrawn:
            e.update(reason="Withdrawn", message="the Mac is draining and this replica is "
                     "replaced elsewhere: out of endpoints; unloaded once that is published and "
                     "its running requests finish")
    serving = [e for e in entries if e["role"] != Role.CANDIDATE.value
               and (e["name"], e["revision"]) not in inp.withdrawn]
    # Ready, or standby (idle-unloaded / reloading for a request): serves on demand
    ready = [e for e in serving if replicas.serves(e["state"], e["reason"])]
    failed = [e for e in serving if e["state"] == AssignmentState.FAILED.value]
    starting = [e for e in serving if e["state"] != AssignmentState.FAILED.value
                and not replicas.serves(e["state"], e["reason"])]
    n_ready = len({e["name"] for e in ready})
    standby_nodes = {e["name"] for e in ready if is_standby(e["state"], e["reason"])} - {
        e["name"] for e in ready if e["state"] == AssignmentState.READY.value}
    n_updated = len({e["name"] for e in ready if e["role"] == Role.STABLE.value})
    desired = inp.replicas

    def cond(ctype: str, status: str, reason: str, message: str) -> dict[str, Any]:
        return condition(ctype, status, reason, message, gen, prev_conditions, stamp)

    held = ((inp.spec_error, "InvalidSpec") if inp.spec_error is not None else
            (inp.source_refused, "SourceRefused") if inp.source_refused is not None else None)
    if held is not None:  # nothing is re-placed: the spec is invalid or its source refused
        why, reason = held
        conditions = [cond("Ready", "False", reason, why),
                      cond("Progressing", "False", reason, why),
                      cond("Degraded", "True", reason, why),
                      cond("Scheduled", "False", reason, why)]
    else:
        if desired == 0:
            ready_c = cond("Ready", "True", "ScaledToZero", "0 replicas requested")
        else:
            detail = (f" ({len(standby_nodes)} in standby: not resident, loaded on demand)"
                      if standby_nodes else "")
            if n_ready >= desired:
                ready_c = cond("Ready", "True", "ReplicasReady",
                               f"{n_ready}/{desired} replicas ready{detail}")
            else:
                ready_c = cond("Ready", "False", "ReplicasNotReady",
                               f"{n_ready}/{desired} replicas ready{detail}")
        if inp.rollout_reason == "Stalled":
            prog_c = cond("Progressing", "False", "RolloutStalled", inp.rollout_message)
        elif starting:
            detail = ", ".join(f"{e['name']} {e['revision']} {e['state']}" for e in starting)
            prog_c = cond("Progressing", "True", "ReplicasStarting",
                          f"{len(starting)} replica(s) starting: {detail}")
        elif inp.rollout_reason == "RollingUpdate":
            prog_c = cond("Progressing", "True", "RollingUpdate", inp.rollout_message)
        elif inp.rollout_reason == "Blocked":
            prog_c = cond("Progressing", "False", "RolloutBlocked", inp.rollout_message)
        elif inp.unplaced > 0:
            prog_c = cond("Progressing", "False", "FailedPlacement", inp.placement_message)
        elif failed:
            prog_c = cond("Progressing", "False", "ReplicaFailed",
                          f"{len(failed)} replica(s) failed")
        else:
            prog_c = cond("Progressing", "False", "Complete",
                          f"{n_ready}/{desired} replicas ready at generation {gen}")
        problems = [f"{e['name']} ({e['revision']}): {e['reason']}: {e['message']}".rstrip(": ")
                    for e in failed]
        if failed:
            deg_c = cond("Degraded", "True", "ReplicaFailed", "; ".join(problems))
        elif inp.unplaced > 0 and inp.rollout_reason == "Complete":
            deg_c = cond("Degraded", "True", "FailedPlacement", inp.placement_message)
        else:
            deg_c = cond("Degraded", "False", "AsExpected", "no failed or unplaced replicas")
        if inp.unplaced > 0:
            sched_c = cond("Scheduled", "False", "Unschedulable", inp.placement_message)
        elif inp.waiting > 0:
            sched_c = cond("Scheduled", "False", "AwaitingEstimate",
                           f"{desired - inp.waiting}/{desired} replicas placed; {inp.waiting} "
                           f"wait for the agents' memory estimate of revision {inp.revision} "
                           "(spec.resources.memory is not set)")
        else:
            sched_c = cond("Scheduled", "True", "Scheduled",
                           f"{desired}/{desired} replicas placed")
        conditions = [ready_c, prog_c, deg_c, sched_c]
    conditions.append(_served_name_condition(inp, cond))
    if inp.source_refused is not None:
        conditions.append(cond("SourceAllowed", "False", "SourceRefused", inp.source_refused))
    elif inp.spec_error is not None:  # no source to judge: what was judged last stays
        conditions.append(cond("SourceAllowed", *_previous_source_allowed(prev_conditions)))
    else:
        conditions.append(cond("SourceAllowed", "True", "SourceAllowed",
                               "spec.model.source is allowed by the fleet's source policy"))
    new_consistent = cond("ReplicasConsistent", *digest_consistency(
        (e["name"], e["revision"], e.get("digest", "")) for e in entries))
    conditions.append(new_consistent)

    # -- events on transitions -----------------------------------------------------------------
    for e in entries:
        before = prev_nodes.get((e["name"], e["revision"]))
        what = f"{e['role'].lower()} revision {e['revision']}"
        if before is None:
            events.append(Event("Normal", "Placed", f"Assigned {what} to node {e['name']}"))
        before_state = before.get("state") if before else None
        was_standby = before is not None and is_standby(before_state or "",
                                                        before.get("reason") or "")
        if e["state"] == AssignmentState.READY.value and before_state != e["state"]:
            if was_standby:
                events.append(Event("Normal", "ReplicaReloaded",
                                    f"Replica of {what} on node {e['name']} was reloaded on "
                                    f"demand and is Ready at {e['endpoint']}"))
            else:
                events.append(Event("Normal", "ReplicaReady",
                                    f"Replica of {what} on node {e['name']} is Ready at "
                                    f"{e['endpoint']}"))
        if (e["state"] == AssignmentState.UNLOADED.value and is_standby(e["state"], e["reason"])
                and not was_standby):
            why, reason = _STANDBY_EVENTS.get(e["reason"], _STANDBY_EVENTS[IDLE_UNLOADED])
            events.append(Event("Normal", reason,
                                f"Replica of {what} on node {e['name']} {why} (standby; the "
                                f"next request reloads it): {e['message']}".rstrip(": ")))
        if e["state"] == AssignmentState.FAILED.value and (
                before_state != e["state"] or (before or {}).get("reason") != e["reason"]):
            events.append(Event("Warning", "ReplicaFailed",
                                f"Replica of {what} on node {e['name']} failed: {e['reason']}: "
                                f"{e['message']}"))
    prev_progress = prev_conditions.get("Progressing", {})
    new_progress = conditions[1]
    if new_progress["reason"] in ("RolloutStalled", "RolloutBlocked") and (
            prev_progress.get("reason") != new_progress["reason"]):
        events.append(Event("Warning", new_progress["reason"], new_progress["message"]))
    # A rollout was under way when the previous status listed a Previous replica: with the
    # usual surge in place, Progressing reads ReplicasStarting (not RollingUpdate) until the
    # last Previous replica goes, so its reason alone would miss the common case.
    was_rolling = prev_progress.get("reason") in (
        "RollingUpdate", "RolloutStalled", "RolloutBlocked") or any(
        n.get("role") == Role.PREVIOUS.value for n in prev_nodes.values())
    if was_rolling and inp.rollout_reason == "Complete" and held is None and not any(
            e["role"] == Role.PREVIOUS.value for e in entries):
        events.append(Event("Normal", "RolloutComplete",
                            f"Revision {inp.revision} serves on {n_updated} node(s); previous "
                            f"revisions unloaded"))
    prev_conflict = prev_conditions.get("ServedNameConflict", {})
    new_conflict = conditions[4]
    if new_conflict["status"] == "True" and (prev_conflict.get("status") != "True"
                                             or prev_conflict.get("message")
                                             != new_conflict["message"]):
        events.append(Event("Warning", "ServedNameConflict", new_conflict["message"]))
    elif new_conflict["status"] == "False" and prev_conflict.get("status") == "True":
        events.append(Event("Normal", "ServedNameConflictResolved", new_conflict["message"]))
    prev_consistent = prev_conditions.get("ReplicasConsistent", {})
    if new_consistent["status"] == "False" and (
            prev_consistent.get("status") != "False"
            or prev_consistent.get("message") != new_consistent["message"]):
        events.append(Event("Warning", "DigestMismatch", new_consistent["message"]))
    prev_degraded = prev_conditions.get("Degraded", {})
    new_degraded = conditions[2]
    if new_degraded["reason"] in ("FailedPlacement", "InvalidSpec", "SourceRefused") and (
            prev_degraded.get("reason") != new_degraded["reason"]
            or prev_degraded.get("message") != new_degraded["message"]):
        events.append(Event("Warning", new_degraded["reason"], new_degraded["message"]))

    status: dict[str, Any] = {
        "observedGeneration": gen,
        "replicas": len({e["name"] for e in serving}),  # observed (spec.replicas: desired)
        "readyReplicas": n_ready,
        "updatedReplicas": n_updated,
        "nodes": entries,
        "endpoints": replicas.endpoints((e["state"], e["reason"], e["endpoint"])
                                        for e in serving),
        "downloads": "; ".join(f"{e['name']}: {e['download']['text']}"
                               for e in entries if "download" in e),
        "conditions": conditions,
        # null removes it (a merge patch) when the operator runs without a router
        "router": ({"url": inp.router_url, "model": inp.served_name}
                   if inp.router_url and inp.served_name else None),
    }
    return status, events


def _previous_source_allowed(prev: Mapping[str, Mapping[str, Any]]) -> tuple[str, str, str]:
    """``(status, reason, message)`` of the previous ``SourceAllowed`` (Unknown when none)."""
    c = prev.get("SourceAllowed") or {}
    if c.get("status") in ("True", "False") and c.get("reason"):
        return c["status"], c["reason"], c.get("message") or ""
    return "Unknown", "InvalidSpec", "the spec is invalid: its source was not judged"


def digest_consistency(replicas: Iterable[tuple[str, str, str]]) -> tuple[str, str, str]:
    """``ReplicasConsistent`` from ``(node, revision, digest)`` per replica (``digest`` ""
    when its agent reported none: not loaded yet, a local source) → ``(status, reason,
    message)``: ``"False", "DigestMismatch"`` when two replicas of one revision report
    different digests (the message names, per such revision, the nodes holding each digest),
    else ``"True", "DigestsMatch"`` when some replica reported one, else ``"Unknown",
    "NoDigests"``."""
    by_revision: dict[str, dict[str, set[str]]] = {}
    for node, revision, digest in replicas:
        if digest:
            by_revision.setdefault(revision, {}).setdefault(digest, set()).add(node)
    if not by_revision:
        return ("Unknown", "NoDigests", "no replica reports a content digest (local file:// "
                "sources are not content-addressed; downloaded ones report it once fetched)")
    split = {rev: d for rev, d in by_revision.items() if len(d) > 1}
    if split:
        parts = []
        for rev in sorted(split):
            held = "; ".join(f"{', '.join(sorted(nodes))} hold {digest}"
                             for digest, nodes in sorted(split[rev].items()))
            parts.append(f"revision {rev}: {held}")
        return ("False", "DigestMismatch",
                "replicas of one revision hold different bytes: " + " | ".join(parts)
                + " (the source changed under the same URI: pin a hub commit, or give each "
                  "version its own mirror path)")
    return ("True", "DigestsMatch",
            "; ".join(f"revision {rev}: {len(next(iter(d.values())))} replica(s) hold "
                      f"{next(iter(d))}" for rev, d in sorted(by_revision.items())))


def _served_name_condition(inp: StatusInput, cond: Any) -> dict[str, Any]:
    """``ServedNameConflict``: True (``NameClaimedByAnother``) while another ModelDeployment in
    the operator's scope claims one of this deployment's served names — the fleet router then
    refuses the name for both (409 ``model_name_conflict``) instead of mixing two models — else
    False (``NoConflict``)."""
    if inp.rivals:
        what = "; ".join(
            f"served model name {name!r} is also claimed by ModelDeployment "
            f"{', '.join(others)}" for name, others in sorted(inp.rivals.items()))
        return cond("ServedNameConflict", "True", "NameClaimedByAnother",
                    f"{what}: the fleet router refuses the name for all of them (409 "
                    "model_name_conflict) until all but one change spec.model.servedModelName "
                    "or are deleted")
    named = f"served model name {inp.served_name!r}" if inp.served_name else "its served names"
    return cond("ServedNameConflict", "False", "NoConflict",
                f"no other ModelDeployment in scope claims {named}")


def status_changed(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    """True when ``new`` differs from ``old`` in any field :func:`compute_status` owns."""
    old = old or {}
    return any(old.get(k) != v for k, v in new.items())

