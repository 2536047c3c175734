"""Converge one ModelDeployment: parse its spec, reconcile (placement → one fenced etcd
transaction, :func:`.reconcile.reconcile`), wake the deployments whose served-name conflict
with it changed (:mod:`.served_names`), compute its status (:func:`.status.compute_status`)
and queue it (:mod:`.status_writer`), post its events. The kopf handlers and the deployment's
daemon call :func:`sync`; every decision is made by the pure modules, this module gathers
their inputs from the :class:`~.runtime.Runtime` and applies their outputs.

An invalid spec becomes a permanent error plus a Warning event and ``InvalidSpec`` conditions,
never a crash; what was placed for the last valid spec stays and keeps being shown. A spec
whose ``spec.model.source`` the fleet's source policy refuses (:mod:`.admission`) is handled
the same way, with ``SourceAllowed=False`` and reason ``SourceRefused``: no assignment is
written for it. A drained
replica whose replacement is Ready is first withdrawn from ``status.endpoints``; its
assignment goes :data:`ENDPOINT_GRACE_SECONDS` after that status is published. A candidate
whose Canary ended likewise stays :data:`ENDPOINT_GRACE_SECONDS` after its traffic split was
removed (:meth:`.records.DeploymentRecord.resident_candidate`).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Mapping
from typing import Any

import kopf

from mlx_fleet.contract import Role
from mlx_fleet.store import StoreError

from . import metrics, served_names
from .admission import source_refusal
from .holders import held_reports
from .placement import PlacementRequest, resolve_memory, revision_estimates
from .records import CandidateIntent, DeploymentKey, SyncedSpec
from .reconcile import ConflictError, Intent, read_fleet, reconcile
from .rollout import DrainState, RevisionTarget
from .runtime import Runtime
from .spec import DeploymentSpec, SpecError, parse_spec, to_assignment
from .status import Event, StatusInput, compute_status, status_changed

__all__ = ["sync", "deployment_intent", "CONFLICT_RETRY_SECONDS", "ENDPOINT_GRACE_SECONDS"]

#: After a reconcile gave up on etcd conflicts, its daemon is woken again after a delay
#: uniform in [0.5, 1.5] × this (jittered, so the losers do not collide again in lockstep).
CONFLICT_RETRY_SECONDS = 1.0
#: Seconds a replica stays assigned after what sends it traffic stops naming it: a drained
#: replica after the status that withdraws it from ``status.endpoints`` is published, a
#: released canary candidate after its traffic split is removed — so that clients and agents
#: stop sending to it before its agent stops taking requests (the role of a Pod's preStop
#: delay in Kubernetes; Argo Rollouts' ``abortScaleDownDelaySeconds`` for the candidate).
ENDPOINT_GRACE_SECONDS = 2.0


def post(body: Mapping[str, Any], events: list[Event]) -> None:
    """Post ``events`` on the object ``body`` (kopf's event poster; each message cut to
    1 024 characters)."""
    for e in events:
        kopf.event(body, type=e.type, reason=e.reason, message=e.message[:1024])


async def publish(rt: Runtime, body: Mapping[str, Any], key: DeploymentKey,
                   status: dict[str, Any], events: list[Event], desired: int, *,
                   at_once: bool = False) -> None:
    """Queue ``status`` when it differs from the last one (:meth:`Runtime.queue_status`),
    post ``events``, set the replica gauges. ``at_once``: patch before returning (raises what
    the patch raises)."""
    previous = rt.deployment(key).status.last or body.get("status") or {}
    if status_changed(previous, status):
        rt.queue_status(key, status)
    if at_once:
        await rt.flush_status(key)
    post(body, events)
    metrics.set_replicas(key[0], key[1], desired, status["readyReplicas"])


async def sync(rt: Runtime, body: Mapping[str, Any], logger: logging.Logger) -> None:
    """Converge one ModelDeployment: placement → fenced etcd txn → status → events.

    Safe to run concurrently with itself (a per-deployment lock) and after a crash at any
    point (every step is idempotent). Raises ``kopf.PermanentError`` for an invalid spec and
    ``kopf.TemporaryError`` for etcd conflicts or outages.
    """
    meta = body.get("metadata", {})
    key: DeploymentKey = (meta["namespace"], meta["name"])
    rec = rt.deployment(key)
    async with rec.lock:
        if meta.get("deletionTimestamp"):
            return
        started = time.perf_counter()
        generation = int(meta.get("generation") or 0)
        previous = rec.status.last or body.get("status") or {}
        spec_dict = dict(body.get("spec") or {})
        try:
            spec = parse_spec(spec_dict)
        except SpecError as e:
            await _hold(rt, body, key, spec_dict, generation, previous, started,
                        spec_error=str(e))
            raise kopf.PermanentError(str(e)) from None
        refused = source_refusal(rt.source_policy, spec.model.source)
        if refused is not None:
            await _hold(rt, body, key, spec_dict, generation, previous, started,
                        source_refused=refused)
            raise kopf.PermanentError(refused)

        rec.observe_spec(SyncedSpec(spec, generation, meta.get("uid", "")))
        now = time.monotonic()
        released = rec.released(now, ENDPOINT_GRACE_SECONDS)
        candidate = rec.resident_candidate(rt.candidate(key), now, ENDPOINT_GRACE_SECONDS)
        try:
            estimates: dict[str, int] = {}
            if not spec.resources.memory_bytes:  # else the override wins: no estimate needed
                # only the estimates of nodes holding a slot of this deployment (.holders):
                # its stored assignments, from the followed view when current (no listing;
                # under the placement lock, like every reader that may reset that view)
                async with rt.placement_lock:
                    held = (await read_fleet(rt.store, rt.keys, rt.fleet_memo,
                                             nodes=rt.placement_nodes(),
                                             assignments=rt.assignments)).of(*key)
                estimates = revision_estimates(rt.reports.get(key, {}), held)
            intent = deployment_intent(
                spec, key, uid=meta.get("uid", ""), generation=generation,
                candidate=candidate, cordoned=rt.cordoned, draining=rt.draining,
                node_labels=rt.node_labels, estimates=estimates)
            result = await reconcile(rt.store, rt.keys, intent, rt.reports.get(key, {}),
                                     writer=rt.writer, released=released,
                                     serialize=rt.placement_lock, memo=rt.fleet_memo,
                                     nodes=rt.placement_nodes(), assignments=rt.assignments,
                                     held=rt.held_nodes)
        except ConflictError as e:
            metrics.TXN_CONFLICTS.inc(e.conflicts)
            metrics.RECONCILE_TOTAL.labels(result="conflict").inc()
            metrics.observe_reconcile(time.perf_counter() - started, success=False)
            # Retry soon from the daemon instead of waiting for the next resync.
            rt.rearm(key, CONFLICT_RETRY_SECONDS * random.uniform(0.5, 1.5))
            raise kopf.TemporaryError(str(e), delay=1) from e
        except StoreError as e:
            metrics.RECONCILE_TOTAL.labels(result="error").inc()
            metrics.observe_reconcile(time.perf_counter() - started, success=False)
            raise kopf.TemporaryError(f"etcd: {e}", delay=5) from e
        metrics.TXN_CONFLICTS.inc(result.conflicts)
        rivals_before = served_names.rivals(key, rt.placed)
        drain_changed = rec.reconciled(result.assignments, unsettled=bool(
            result.decision.unplaced or result.decision.waiting
            or (result.candidate is not None and result.candidate.unplaced)
            or result.rollout.reason != "Complete" or result.drain != DrainState()),
            drain=result.drain)
        if result.written or drain_changed:
            rt.macnode_wake.set()  # reserved memory / models / drain progress changed
        rt.wake_canary(key)
        rivals = served_names.rivals(key, rt.placed)
        rt.wake(served_names.to_wake(rivals_before, rivals))  # their condition changes too

        reports = held_reports(rt.reports.get(key, {}), result.assignments)
        status, events = compute_status(StatusInput(
            generation=generation, replicas=spec.replicas, assignments=result.assignments,
            reports=reports, nodes=dict(rt.nodes), unplaced=result.decision.unplaced,
            placement_message=result.decision.message, revision=spec.model.revision,
            rollout_reason=result.rollout.reason, rollout_message=result.rollout.message,
            withdrawn=frozenset(result.drain.withdraw), waiting=result.decision.waiting,
            served_name=spec.served_name(key[1]), rivals=rivals, router_url=rt.router_url),
            previous)
        # a status that withdraws endpoints is patched now: the grace counts from its patch
        await publish(rt, body, key, status, events, spec.replicas,
                       at_once=bool(result.drain.withdraw))
        # withdrawn from the endpoints now that this status is published: removed after the grace
        # ... and a released candidate is unloaded by the sync after its own grace
        now = time.monotonic()
        first = rec.withdraw(result.drain.withdraw, now)
        dues = [d for d in (None if first is None else first + ENDPOINT_GRACE_SECONDS - now,
                            rec.candidate_unloads_in(now, ENDPOINT_GRACE_SECONDS))
                if d is not None]
        if dues:
            rt.rearm(key, max(min(dues), 0.0) + 0.05)
        metrics.RECONCILE_TOTAL.labels(result="changed" if result.written else "unchanged").inc()
        metrics.RECONCILE_DURATION.observe(time.perf_counter() - started)


async def _hold(rt: Runtime, body: Mapping[str, Any], key: DeploymentKey,
                spec_dict: Mapping[str, Any], generation: int, previous: Mapping[str, Any],
                started: float, *, spec_error: str | None = None,
                source_refused: str | None = None) -> None:
    """An invalid spec (``spec_error``) or a refused source (``source_refused``): nothing is
    re-placed, but what was placed for the last admitted spec stays in etcd and keeps being
    served, so the status shows those replicas (and their reports) with ``InvalidSpec`` /
    ``SourceRefused`` conditions; the Warning event is among the status's events (posted on
    the transition only). Raises ``kopf.TemporaryError`` when etcd can't be read."""
    metrics.RECONCILE_TOTAL.labels(result="invalid").inc()
    replicas = spec_dict.get("replicas")
    replicas = replicas if isinstance(replicas, int) else 0
    try:
        placed = {slot: s.assignment for slot, s in
                  (await read_fleet(rt.store, rt.keys)).of(*key).items()
                  if s.assignment is not None}
    except StoreError as se:
        metrics.RECONCILE_TOTAL.labels(result="error").inc()
        metrics.observe_reconcile(time.perf_counter() - started, success=False)
        raise kopf.TemporaryError(f"etcd: {se}", delay=5) from se
    reports = held_reports(rt.reports.get(key, {}), placed)
    status, events = compute_status(StatusInput(
        generation=generation, replicas=replicas, assignments=placed, reports=reports,
        nodes=dict(rt.nodes), spec_error=spec_error, source_refused=source_refused,
        rivals=served_names.rivals(key, rt.placed)), previous)
    await publish(rt, body, key, status, events, replicas)
    metrics.observe_reconcile(time.perf_counter() - started, success=False)


def deployment_intent(spec: DeploymentSpec, key: DeploymentKey, *, uid: str, generation: int,
                      candidate: CandidateIntent | None,
                      cordoned: frozenset[str] = frozenset(),
                      draining: frozenset[str] = frozenset(),
                      node_labels: Mapping[str, Mapping[str, str]] | None = None,
                      estimates: Mapping[str, int] | None = None) -> Intent:
    """The :class:`~.reconcile.Intent` of a parsed ModelDeployment spec: its stable revision,
    and the candidate a running Canary keeps resident (ignored when it names the stable
    revision itself — the moment of a promotion). ``estimates``: revision → the agents'
    largest memory estimate (:func:`~.placement.revision_estimates`), used where
    ``spec.resources.memory`` is unset (:func:`~.placement.resolve_memory`). ``node_labels``:
    node name → its MacNode's labels (:attr:`.runtime.Runtime.node_labels`)."""
    estimates = estimates or {}
    served = spec.served_name(key[1])
    memory = resolve_memory(spec.resources.memory_bytes,
                            [estimates.get(spec.model.revision, 0)])
    request = PlacementRequest(
        namespace=key[0], name=key[1], replicas=spec.replicas, revision=spec.model.revision,
        memory_bytes=memory or 0, estimate_pending=memory is None,
        node_selector=spec.placement.node_selector,
        min_chip_generation=spec.placement.min_chip_generation,
        strategy=spec.placement.strategy, served_model_name=served, cordoned=frozenset(cordoned),
        draining=frozenset(draining), node_labels=node_labels or {}, task=spec.model.task)
    stable = RevisionTarget(request, to_assignment(spec, namespace=key[0], name=key[1], uid=uid,
                                                   generation=generation, memory_bytes=memory))
    cand = None
    if candidate is not None and candidate.revision != spec.model.revision:
        memory = candidate.memory_bytes or resolve_memory(
            spec.resources.memory_bytes, [estimates.get(candidate.revision, 0)])
        cand = RevisionTarget(
            dataclasses.replace(request, revision=candidate.revision, memory_bytes=memory or 0,
                                estimate_pending=memory is None),
            to_assignment(spec, namespace=key[0], name=key[1], uid=uid, generation=generation,
                          role=Role.CANDIDATE, source=candidate.source,
                          revision=candidate.revision, memory_bytes=memory))
    surge, unavailable = spec.surge_limits()
    return Intent(stable=stable, candidate=cand, max_surge=surge, max_unavailable=unavailable,
                  min_ready=spec.lifecycle.min_ready)

