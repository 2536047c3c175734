"""kopf handlers for ``canaries.mlx-fleet.io/v1alpha1``: gather inputs, apply outputs.

Every decision is pure: :func:`~.canary_spec.parse_canary_spec` (the spec),
:func:`~.analysis.analyze` (one window, candidate vs stable), :func:`~.canary.step` (the step
machine). A daemon per Canary ticks — every :data:`TICK_SECONDS`, and at once when its target's
reports or statistics change (a local guard trip wakes it) — and applies the decision:

* :meth:`.runtime.Runtime.keep_candidate` tells the target ModelDeployment's reconcile to keep the
  candidate revision resident (one writer per deployment's assignments: the ModelDeployment's
  own fenced transaction), or to unload it once the canary ends;
* the :class:`~mlx_fleet.contract.TrafficSplit` in etcd (``traffic/<ns>/<target>``) carries the
  weight, the local guard and the nodes serving the candidate (for forwarding); it is deleted
  when the canary ends, so all traffic returns to the stable revision. The end is applied in
  that order: until the split is deleted nothing else of it is (no release, no status, no
  events: the next tick decides again); then the candidate is released and unloaded the
  endpoint grace later (:meth:`.records.DeploymentRecord.resident_candidate`), and a new
  Canary of the same target waits for that grace before it starts;
* promotion patches the target's ``spec.model.revision`` (and ``source``) to the candidate: the
  candidate's assignments become Stable without a reload, the old revision is unloaded;
* ``status`` (phase, step, weight, the last analysis per check), conditions, a Kubernetes event
  per transition, and the metrics.

Manual actions are annotations whose *value* is a fresh token (the CLI writes a timestamp):
``mlx-fleet.io/promote`` (advance past the current step or pause), ``mlx-fleet.io/promote-full``
(promote now), ``mlx-fleet.io/abort``. Cross-object rules the CRD schema cannot express — the
candidate revision differs from the target's, one active Canary per target — are checked here:
the Canary fails with reason ``InvalidSpec`` or ``TargetBusy`` and a Warning event; a
``spec.candidate.source`` the fleet's source policy refuses (:mod:`.admission`) fails it with
reason ``SourceRefused`` (and a Warning event), before any candidate is placed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import kopf

from mlx_fleet.contract import AssignmentState, Role, TrafficSplit
from mlx_fleet.routing import replicas
from mlx_fleet.store import Compare, Delete, Put, StoreError
from mlx_fleet.supervise import wait_event

from . import metrics
from .analysis import AnalysisResult, analyze, window_from_reports
from .canary import TERMINAL, CanaryState, Observation, Phase, step
from .canary_spec import CanarySpec, CanarySpecError, parse_canary_spec, to_local_guard
from .config import listed_namespaces
from .holders import current_report, held_stats
from .kube import CANARY_PLURAL, GROUP, PLURAL, VERSION, patch_object
from .runtime import Runtime, runtime
from .records import AnalysisWindow, CandidateIntent, DeploymentKey
from .admission import CANDIDATE_SOURCE_FIELD, SOURCE_REFUSED, source_refusal
from .status import _condition, now_rfc3339
from .sync import ENDPOINT_GRACE_SECONDS

if TYPE_CHECKING:
    from kubernetes.client import CustomObjectsApi

log = logging.getLogger(__name__)

ANNOTATION_PROMOTE = "mlx-fleet.io/promote"
ANNOTATION_PROMOTE_FULL = "mlx-fleet.io/promote-full"
ANNOTATION_ABORT = "mlx-fleet.io/abort"
#: Seconds between ticks of a Canary's daemon when nothing wakes it earlier.
TICK_SECONDS = 1.0

_RESOURCE = dict(group=GROUP, version=VERSION, plural=CANARY_PLURAL)


def _observe(rt: Runtime, spec: CanarySpec, state: CanaryState, target: DeploymentKey,
             uid: str, annotations: Mapping[str, str], now: float) -> Observation:
    """Gather what the step machine looks at from the operator's in-memory views."""
    dep = rt.synced(target)
    ann = {k: str(v) for k, v in (annotations or {}).items()}
    tokens = dict(promote_token=ann.get(ANNOTATION_PROMOTE, ""),
                  promote_full_token=ann.get(ANNOTATION_PROMOTE_FULL, ""),
                  abort_token=ann.get(ANNOTATION_ABORT, ""))
    if dep is None:
        return Observation(target_revision="", target_exists=False, **tokens)
    dspec = dep.spec
    rec = rt.deployment(target)
    cand = spec.candidate.revision
    placed = rec.placed
    reports = rt.reports.get(target, {})

    def state_of(slot: tuple[str, str]) -> AssignmentState | None:
        """The slot's state for the stored record's generation; a standby replica (idle-
        unloaded, reloading on demand) counts as Ready: it serves on demand."""
        r = current_report(slot, reports, placed)
        if r is None:
            return None
        return AssignmentState.READY if replicas.serves(r.state, r.reason) else r.state

    cand_slots = [s for s in placed if s[1] == cand]
    stable_slots = [s for s in placed if s[1] == dspec.model.revision and s[1] != cand]
    failed = [f"{n}: {reports[(n, r)].reason}: {reports[(n, r)].message}" for n, r in cand_slots
              if state_of((n, r)) == AssignmentState.FAILED]
    # only nodes holding a slot of the target count (another node's agent credential could
    # write stats carrying this canary's uid: a forged guard trip or skewed windows)
    stats = {n: r for n, r in held_stats(rt.stats.get(target, {}), placed).items()
             if r.canary_uid == uid}
    tripped = next((f"node {n}: {r.guard_reason}" for n, r in sorted(stats.items())
                    if r.guard_tripped), None)
    analysis: AnalysisResult | None = None
    memory = rt.canary(uid)
    win = memory.window
    if state.phase in (Phase.PROGRESSING, Phase.PAUSED) and (
            win is None or now - win.at >= spec.analysis.interval_seconds):
        baseline = win.baseline if win is not None else None
        if win is not None:
            stable_w = window_from_reports(stats, win.reports, state.stable_revision
                                           or dspec.model.revision)
            cand_w = window_from_reports(stats, win.reports, cand)
            # Near 100 % the stable revision gets (almost) no requests: the candidate is then
            # judged against the last stable window that had enough of them (same canary).
            if stable_w.requests >= spec.analysis.min_requests:
                baseline = stable_w
            elif baseline is not None:
                stable_w = baseline
            analysis = analyze(spec.analysis, stable_w, cand_w,
                               canary_elapsed_hours=max(now - state.started, 0) / 3600
                               if state.started else 0.0,
                               memory_start=state.memory_baseline_bytes)
        memory.window = AnalysisWindow(now, dict(stats), baseline)
    cand_mem = max((r.revisions[cand].memory_bytes for r in stats.values()
                    if cand in r.revisions), default=0)
    md_status = rec.status.last or {}
    progressing = next((c for c in md_status.get("conditions", [])
                        if c.get("type") == "Progressing"), {})
    return Observation(
        target_revision=dspec.model.revision, target_exists=True,
        candidate_ready=bool(cand_slots) and all(
            state_of(s) == AssignmentState.READY for s in cand_slots),
        candidate_failed="; ".join(failed) or None,
        stable_ready=any(state_of(s) == AssignmentState.READY for s in stable_slots)
        and not any(state_of(s) == AssignmentState.FAILED for s in stable_slots),
        guard_tripped=tripped, analysis=analysis,
        rollout_complete=(dspec.model.revision == cand
                          and progressing.get("reason") == "Complete"
                          and md_status.get("updatedReplicas", 0) >= 1),
        candidate_memory_bytes=cand_mem, **tokens)


def _split(rt: Runtime, spec: CanarySpec, state: CanaryState, target: DeploymentKey,
           name: str, uid: str, generation: int, weight: int) -> TrafficSplit | None:
    dep = rt.synced(target)
    if dep is None:
        return None
    dspec = dep.spec
    rec = rt.deployment(target)
    cand = spec.candidate.revision
    placed = rec.placed
    reports = rt.reports.get(target, {})
    withdrawn = rec.withdrawn  # drained replicas on their way out: not forwarded to
    endpoints = replicas.endpoints((reports[s].state, reports[s].reason, reports[s].endpoint)
                                   for s in placed if s[1] == cand and s in reports
                                   and s not in withdrawn)
    return TrafficSplit(
        namespace=target[0], name=target[1],
        served_model_name=dspec.served_name(target[1]),
        stable_revision=state.stable_revision or dspec.model.revision, candidate_revision=cand,
        weight=weight, canary=name, canary_uid=uid, generation=generation,
        stats_interval_seconds=spec.analysis.interval_seconds, candidate_endpoints=endpoints,
        guard=to_local_guard(spec))


async def _write_split(rt: Runtime, target: DeploymentKey, split: TrafficSplit | None) -> bool:
    """Put (or delete, for None) the target's split when it differs from what is stored;
    compared on its mod_revision, so a concurrent writer is never clobbered. Returns whether
    the store now holds ``split`` (False: a concurrent write won; the next tick retries).
    Raises :class:`~mlx_fleet.store.StoreError` when etcd can't be reached."""
    key = rt.keys.traffic(*target)
    have = await rt.store.get(key)
    if split is None:
        if have is None:
            return True
        return bool(await rt.store.txn([Compare(key, "mod", "==", have.mod_revision)],
                                       [Delete(key)]))
    if have is not None:
        with contextlib.suppress(ValueError):
            if TrafficSplit.from_json(have.value) == split:
                return True
    return bool(await rt.store.txn(
        [Compare(key, "mod", "==", have.mod_revision if have else 0)],
        [Put(key, split.to_json())]))


def _lingering(rt: Runtime, target: DeploymentKey, canary: str, revision: str) -> float | None:
    """Seconds until a candidate another Canary (or this one, of another revision) released on
    ``target`` unloads — a new candidate waits for them, since placement keeps one candidate
    per target; None when there is none."""
    rec = rt.existing(target)
    if rec is None or rt.candidate(target) is not None or rec.released_candidate is None:
        return None
    gone = rec.released_candidate.intent
    if (gone.canary, gone.revision) == (canary, revision):
        return None
    return rec.candidate_unloads_in(time.monotonic(), ENDPOINT_GRACE_SECONDS)


async def _patch(rt: Runtime, plural: str, namespace: str, name: str, body: dict[str, Any],
                 subresource: str = "") -> None:
    if rt.custom_api is None:
        raise RuntimeError("no Kubernetes client to patch with")
    await patch_object(rt.custom_api, plural, namespace, name, body,
                       status=subresource == "status")


def _conditions(state: CanaryState, generation: int, previous: Mapping[str, Any]
                ) -> list[dict[str, Any]]:
    prev = {c.get("type"): c for c in previous.get("conditions") or [] if isinstance(c, Mapping)}
    stamp = now_rfc3339()
    phase = state.phase
    reason = state.reason or phase.value
    msg = state.message or phase.value

    def cond(t: str, s: str, r: str, m: str) -> dict[str, Any]:
        return _condition(t, s, r, m, generation, prev, stamp)

    running = phase not in TERMINAL
    return [
        cond("Progressing", "True" if running else "False", reason, msg),
        cond("Succeeded", "True" if phase == Phase.SUCCEEDED else "False", reason, msg),
        cond("Degraded", "True" if phase in (Phase.ROLLED_BACK, Phase.FAILED) else "False",
             reason if phase in (Phase.ROLLED_BACK, Phase.FAILED) else "AsExpected", msg),
    ]


def _fail(state: CanaryState, reason: str, message: str,
          candidate: str | None = None) -> CanaryState:
    """``candidate``: the revision the failure is about. It is recorded, so that the next tick's
    step machine sees a terminal canary of that candidate — not a new one to start (which
    would take over a busy target, or "promote" the target's own revision)."""
    return dataclasses.replace(state, phase=Phase.FAILED, weight=0, reason=reason,
                               message=message,
                               candidate_revision=candidate or state.candidate_revision)


async def tick(rt: Runtime, body: Mapping[str, Any], now: float | None = None) -> float:
    """One tick of one Canary: observe, decide, apply. Returns seconds until the next one."""
    now = time.time() if now is None else now
    meta = body.get("metadata", {})
    namespace, name, uid = meta["namespace"], meta["name"], meta.get("uid", "")
    generation = int(meta.get("generation") or 0)
    previous = dict(body.get("status") or {})
    previous.update(rt.canary(uid).last_status)
    state = CanaryState.from_status(previous)
    events: list[tuple[str, str, str]] = []
    promote: str | None = None
    weight = state.weight
    keep = state.phase not in TERMINAL
    try:
        spec = parse_canary_spec(body.get("spec") or {})
    except CanarySpecError as e:
        spec = None
        if state.reason != "InvalidSpec":
            events.append(("Warning", "InvalidSpec", str(e)))
        state, weight, keep = _fail(state, "InvalidSpec", str(e)), 0, False
    target: DeploymentKey = (namespace, (body.get("spec") or {}).get("targetRef", {}).get(
        "name", ""))
    if spec is not None:
        target = (namespace, spec.target_ref.name)
        owner = rt.candidate(target)
        dep = rt.synced(target)
        # (Re)starting: the first tick, or the spec names another candidate than the one the
        # state is about (a terminal canary restarts then).
        starting = state.candidate_revision != spec.candidate.revision
        refused = source_refusal(rt.source_policy, spec.candidate.source,
                                 CANDIDATE_SOURCE_FIELD)
        if refused is not None:  # no candidate is kept: no assignment is written for it
            if state.reason != SOURCE_REFUSED:
                events.append(("Warning", SOURCE_REFUSED, refused))
            state = _fail(state, SOURCE_REFUSED, refused, spec.candidate.revision)
            weight, keep = 0, False
        elif owner is not None and owner.canary != name and (
                state.phase not in TERMINAL or starting):
            msg = (f"spec.targetRef.name: ModelDeployment {target[1]} already has an active "
                   f"Canary {owner.canary}")
            events.append(("Warning", "TargetBusy", msg))
            state = _fail(state, "TargetBusy", msg, spec.candidate.revision)
            weight, keep = 0, False
        elif (starting and dep is not None
              and dep.spec.model.revision == spec.candidate.revision):
            msg = (f"spec.candidate.revision: {spec.candidate.revision} is already the "
                   f"revision of ModelDeployment {target[1]}")
            events.append(("Warning", "InvalidSpec", msg))
            state = _fail(state, "InvalidSpec", msg, spec.candidate.revision)
            weight, keep = 0, False
        elif (state.phase not in TERMINAL or starting) and (wait := _lingering(
                rt, target, name, spec.candidate.revision)) is not None:
            return wait + 0.05  # the last candidate still unloads: start after it
        else:
            obs = _observe(rt, spec, state, target, uid, meta.get("annotations") or {}, now)
            d = step(spec, state, obs, now)
            state, weight, keep, promote = d.state, d.weight, d.keep_candidate, d.promote_revision
            events.extend(d.events)

    # -- apply ---------------------------------------------------------------------------------
    keep = keep and spec is not None
    if spec is not None and keep:
        intent = CandidateIntent(name, spec.candidate.revision, spec.candidate.source,
                                 spec.candidate.memory_bytes)
        rt.keep_candidate(target, intent)
    written = True  # the store holds this tick's split (or another Canary's, left alone)
    try:
        split = (_split(rt, spec, state, target, name, uid, generation, weight)
                 if spec is not None and keep else None)
        owner = rt.candidate(target)
        if split is not None or owner is None or owner.canary == name:
            written = await _write_split(rt, target, split)
    except StoreError as e:
        written = False
        log.warning("canary %s/%s: writing the traffic split failed (retrying): %s",
                    namespace, name, e)
    if not keep:
        if not written:  # the split still sends traffic to the candidate: the end waits
            return TICK_SECONDS
        # released only now that its split is gone: the agents stop routing to the
        # candidate, and the target's reconcile unloads it after the endpoint grace
        rt.release_candidate(target, name)
    if promote is not None and spec is not None:
        patch: dict[str, Any] = {"revision": promote}
        if spec.candidate.source:
            patch["source"] = spec.candidate.source
        if spec.candidate.memory_bytes:
            await _patch(rt, PLURAL, namespace, target[1],
                         {"spec": {"model": patch,
                                   "resources": {"memory": str(spec.candidate.memory_bytes)}}})
        else:
            await _patch(rt, PLURAL, namespace, target[1], {"spec": {"model": patch}})
        log.info("canary %s/%s: promoted %s to revision %s", namespace, name, target[1], promote)
    status = state.to_status() | {"observedGeneration": generation,
                                  "currentStepIndex": state.step_index,
                                  "currentWeight": weight}
    status["conditions"] = _conditions(state, generation, previous)
    if any(previous.get(k) != v for k, v in status.items() if k != "conditions") or any(
            (c["status"], c["reason"]) != (p.get("status"), p.get("reason"))
            for c, p in zip(status["conditions"], previous.get("conditions") or [{}] * 3)):
        await _patch(rt, CANARY_PLURAL, namespace, name, {"status": status}, "status")
        rt.canary(uid).last_status = status
    for type_, reason, message in events:
        kopf.event(body, type=type_, reason=reason, message=message[:1024])
        if reason in {p for p in metrics.CANARY_PHASES}:
            metrics.CANARY_TRANSITIONS.labels(namespace=namespace, name=name, phase=reason).inc()
    if events:
        log.info("canary %s/%s: %s", namespace, name,
                 "; ".join(f"{r}: {m}" for _, r, m in events))
    metrics.set_canary(namespace, name, target[1], state.phase.value, weight)
    return TICK_SECONDS


@kopf.on.resume(**_RESOURCE)
@kopf.on.create(**_RESOURCE)
@kopf.on.update(**_RESOURCE)
async def canary_changed(body: kopf.Body, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    """A new or edited Canary: wake its daemon (which owns every tick)."""
    target = (namespace, (body.get("spec") or {}).get("targetRef", {}).get("name", ""))
    runtime(memo).wake_canary(target)


@kopf.daemon(**_RESOURCE, cancellation_timeout=10.0)
async def follow_canary(stopped: kopf.DaemonStopped, body: kopf.Body, logger: logging.Logger,
                        namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    """Tick the Canary every :data:`TICK_SECONDS` and whenever its target's reports or
    statistics change."""
    rt = runtime(memo)
    target = (namespace, (body.get("spec") or {}).get("targetRef", {}).get("name", ""))
    wake = rt.canary_wakeup(target)

    async def relay_stop() -> None:
        await stopped.wait()
        wake.set()

    relay = asyncio.create_task(relay_stop())
    delay = TICK_SECONDS
    try:
        while not stopped:
            await wait_event(wake, delay)
            wake.clear()
            if stopped:
                break
            try:
                delay = await tick(rt, body)
            except Exception:  # keep following; the next tick retries
                logger.exception("tick of canary %s/%s failed", namespace, name)
                delay = TICK_SECONDS
    finally:
        relay.cancel()


@kopf.on.delete(**_RESOURCE)
async def canary_deleted(body: kopf.Body, namespace: str, name: str, memo: kopf.Memo,
                         **_: Any) -> None:
    """Deleting a Canary returns all traffic to the stable revision and unloads the candidate
    (unless it was promoted: then it *is* the stable revision)."""
    rt = runtime(memo)
    target = (namespace, (body.get("spec") or {}).get("targetRef", {}).get("name", ""))
    owner = rt.candidate(target)
    if owner is not None and owner.canary == name:
        try:
            deleted = await _write_split(rt, target, None)
        except StoreError as e:
            raise kopf.TemporaryError(f"etcd: {e}", delay=2) from e
        if not deleted:
            raise kopf.TemporaryError("the traffic split changed meanwhile", delay=1)
        rt.release_candidate(target, name)  # unloaded after the endpoint grace
    uid = (body.get("metadata") or {}).get("uid", "")
    rt.forget_canary(uid)
    metrics.forget_canary(namespace, name)


def seed_candidates(api: CustomObjectsApi, namespaces: tuple[str, ...] = ()
                    ) -> dict[DeploymentKey, CandidateIntent]:
    """At start-up, before any ModelDeployment is re-synced: the candidates of running Canaries
    (from their stored ``status``), so an operator restart mid-canary never unloads a warm
    candidate. ``namespaces``: the operator's ``--namespace`` values — exact names are listed
    one by one (its Roles grant no more, :func:`.config.listed_namespaces`), else the listing is
    cluster-wide. Blocking (run in a thread)."""
    out: dict[DeploymentKey, CandidateIntent] = {}
    listed = listed_namespaces(namespaces)
    if listed is None:
        items = api.list_cluster_custom_object(GROUP, VERSION, CANARY_PLURAL,
                                               _request_timeout=30)["items"]
    else:
        items = [o for ns in listed for o in api.list_namespaced_custom_object(
            GROUP, VERSION, ns, CANARY_PLURAL, _request_timeout=30)["items"]]
    for o in items:
        st = CanaryState.from_status(o.get("status"))
        if st.phase in TERMINAL or not st.candidate_revision:
            continue
        try:
            spec = parse_canary_spec(o.get("spec") or {})
        except CanarySpecError:
            continue
        ns = o["metadata"]["namespace"]
        out[(ns, spec.target_ref.name)] = CandidateIntent(
            o["metadata"]["name"], spec.candidate.revision, spec.candidate.source,
            spec.candidate.memory_bytes)
    return out


__all__ = ["tick", "seed_candidates", "ANNOTATION_PROMOTE", "ANNOTATION_PROMOTE_FULL",
           "ANNOTATION_ABORT", "CANARY_PLURAL", "Role"]
