"""Every convergence decision of the agent: plain functions over the :class:`~.state.Record`\\ s,
an observation of the serving core (:class:`CoreView`) and ``now`` (the controller's injected
clock). They return what to do — start or cancel a key's task and when to wake for a retry
(:func:`plan`), how one key's task converges (:func:`converge`: report, wait for a request, or
load — and what to let go or forget first), what a failure's back-off is (:func:`failed`),
whether a load fits or what to evict first (:func:`room`), which standby revisions to prefetch
(:func:`prefetches`), whether a revision may be unloaded to standby (:func:`may_unload`), how a
request for a standby revision is admitted (:func:`admit`), what retiring a key drops
(:func:`retire`) — and the views the HTTP side reads (:func:`served`, :func:`standby_models`).

The executor (:mod:`.keytask`, :mod:`.load`, :mod:`.unload`, :mod:`.demand`, wired by
:class:`~node_agent.controller.Controller`) gathers the observation, calls these and carries out
the result; nothing here awaits, reads a clock or touches etcd or MLX. The rules are documented
on each function and in :mod:`node_agent.controller`; the arithmetic of idle unload, eviction
and prediction is in :mod:`node_agent.lifecycle`.

Pure: standard library, :mod:`mlx_fleet.contract`, :mod:`mlx_fleet.quantity`,
:mod:`node_agent.lifecycle` and :mod:`.state` only.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable, Mapping

from mlx_fleet.contract import (IDLE_UNLOADED, PREFETCH_ON_DEMAND, Assignment,
                                DownloadProgress, Role)
from mlx_fleet.quantity import format_bytes

from ..lifecycle import ConvergePlan, KeyState, ModelUse, UsageHistory, evictions, \
    plan_convergence, predict_prefetch
from .state import (INSUFFICIENT_MEMORY, MODEL_LIMIT, PERMANENT_REASONS, Desired, Failure,
                    Ident, Invalid, Loaded, Record, ServedModel, Spec, StandbyModel)

__all__ = ["RESIDUE", "CoreView", "Action", "Converge", "Room", "RoomObservation", "Admission",
           "Admit", "Retire", "target", "key_state", "plan", "converge", "name_owner",
           "Opening", "opening", "shows_progress", "known_estimate", "failed",
           "room", "in_use", "resident_count", "model_uses", "may_unload", "prefetches",
           "admit", "retire", "holds", "served", "standby_models"]

#: ``done`` of a key that is not assigned and has something left (a report, a failure, a
#: loaded revision), so that :func:`plan` starts a task that retires it.
RESIDUE = "<residue>"


@dataclasses.dataclass(frozen=True)
class CoreView:
    """The serving core at one moment. ``memory``: every revision it holds (draining ones
    included) → its ``ServingCore.memory_bytes``; ``serving``: those that take requests
    (``ServingCore.is_loaded``)."""

    memory: Mapping[Ident, int] = dataclasses.field(default_factory=dict)
    serving: frozenset[Ident] = frozenset()


# -- the converge worker ------------------------------------------------------------------------
def target(d: Desired | None) -> Spec | Invalid | None:
    """What a change of restarts ``d``'s task: its spec (an invalid value: itself)."""
    return Spec.of(d) if isinstance(d, Assignment) else d


def key_state(rec: Record) -> KeyState:
    """``rec`` as :func:`~node_agent.lifecycle.plan_convergence` sees it. A key no longer
    assigned with something left of it (a loaded revision, a failure, a report) and no task
    counts as converged to :data:`RESIDUE`, so a task retires it."""
    t = target(rec.desired)
    done = rec.done
    if (rec.desired is None and done is None and not rec.busy
            and (rec.loaded is not None or rec.failure is not None or rec.reported)):
        done = RESIDUE
    f = rec.failure
    return KeyState(desired=rec.desired, target=t, busy=rec.busy, running=rec.running,
                    done=done, retry_at=f.retry_at if f is not None and f.spec == t else None)


def plan(records: Mapping[str, Record], now: float) -> ConvergePlan:
    """Which keys' tasks to cancel and start at ``now``, and when the next retry is due
    (:func:`~node_agent.lifecycle.plan_convergence` over :func:`key_state` of each record)."""
    return plan_convergence({k: key_state(r) for k, r in records.items()}, now)


class Action(str, enum.Enum):
    """What one key's task does (:func:`converge`)."""

    REPORT_INVALID = "ReportInvalid"    # Failed/InvalidAssignment; the failure is forgotten
    REPORT_LOADED = "ReportLoaded"      # Ready, or Unloaded when in standby (generation moved)
    REPORT_FAILED = "ReportFailed"      # waiting for its retry (or not retried): Failed again
    REPORT_CONFLICT = "ReportConflict"  # Failed/ModelNameConflict naming ``owner``
    AWAIT_REQUEST = "AwaitRequest"      # OnDemand: standby until the first request
    LOAD = "Load"                       # fetch, check and load (``failure``: the one retried)


@dataclasses.dataclass(frozen=True)
class Converge:
    """One key's task's decision. ``let_go``: the loaded revision is now served under another
    name — drain it (or forget it in standby) first; ``failure``: for ``REPORT_FAILED`` the
    failure to report, for ``LOAD`` the failure this attempt retries (None: a first attempt);
    ``owner``: for ``REPORT_CONFLICT`` the key that holds the name; ``forget``: for ``LOAD``
    an earlier attempt's spec under another name whose series and history go."""

    action: Action
    let_go: bool = False
    failure: Failure | None = None
    owner: str = ""
    forget: Spec | None = None


def name_owner(records: Mapping[str, Record], key: str, model_id: str) -> str | None:
    """The key of another deployment's revision that serves ``model_id`` here — loaded (or in
    standby), else being loaded — or None."""
    mine = records[key].deployment
    for k, r in records.items():
        if (k != key and r.loaded is not None and r.loaded.spec.model_id == model_id
                and r.deployment != mine):
            return k
    for k, r in records.items():
        if k != key and r.claim == model_id and r.deployment != mine:
            return k
    return None


def converge(key: str, d: Desired, records: Mapping[str, Record], now: float, *,
             draining: Iterable[Ident] = ()) -> Converge:
    """How ``key``'s task brings it to ``d`` at ``now``:

    1. an invalid value is reported Failed/InvalidAssignment;
    2. a loaded revision now served under another name is let go first;
    3. the spec is loaded already (or in standby): report it (the generation may have moved);
    4. a failure of this spec whose retry is not due (or never comes) is reported again;
    5. the served name is another deployment's here (:func:`name_owner`): ModelNameConflict;
    6. ``lifecycle.prefetch: OnDemand`` with no failure and nothing resident: standby until the
       first request (nothing fetched);
    7. else load it — a new spec at once (attempts start over), a due retry with its failure —
       forgetting an earlier attempt under another name unless that revision drains (``draining``,
       or the let-go of rule 2: the drain forgets it once done)."""
    if isinstance(d, Invalid):
        return Converge(Action.REPORT_INVALID)
    rec = records[key]
    spec = Spec.of(d)
    loaded = rec.loaded
    let_go = loaded is not None and loaded.spec.model_id != spec.model_id
    if let_go:
        loaded = None
    if loaded is not None and loaded.spec == spec:
        return Converge(Action.REPORT_LOADED, let_go)
    failure = rec.failure if rec.failure is not None and rec.failure.spec == spec else None
    if failure is not None and (failure.retry_at is None or now < failure.retry_at):
        return Converge(Action.REPORT_FAILED, let_go, failure)
    owner = name_owner(records, key, spec.model_id)
    if owner is not None:
        return Converge(Action.REPORT_CONFLICT, let_go, owner=owner)
    if d.lifecycle.prefetch == PREFETCH_ON_DEMAND and failure is None and (
            loaded is None or loaded.standby):
        return Converge(Action.AWAIT_REQUEST, let_go)
    tried = rec.attempted
    draining = {*draining, *_drained_by(rec.loaded if let_go else None)}
    forget = (tried if tried is not None and tried.ident not in {spec.ident, *draining}
              else None)
    return Converge(Action.LOAD, let_go, failure, forget=forget)


def _drained_by(let_go: Loaded | None) -> set[Ident]:
    """The revision that letting ``let_go`` go drains (none when it is in standby: it is
    forgotten at once)."""
    return {let_go.spec.ident} if let_go is not None and not let_go.standby else set()


class Opening(str, enum.Enum):
    """The report a load opens with (:func:`opening`)."""

    RELOADING = "Reloading"      # Loading with the reload's reason (on demand, prefetch)
    PREFETCHING = "Prefetching"  # a remote source is downloaded first (empty progress)
    LOADING = "Loading"          # a local source is loaded
    QUIET = "Quiet"              # a retry: the report stays Failed (no Loading flicker)


def opening(*, on_demand: bool, retried: bool, remote: bool) -> Opening:
    """The report a load of a revision opens with: a reload of a standby revision says
    ``Loading`` with its reason at once; a retry of a failed load says nothing (its report
    stays ``Failed`` until it succeeds, or until a download shows progress,
    :func:`shows_progress`); a first load says ``Prefetching`` for a remote source, else
    ``Loading``."""
    if on_demand:
        return Opening.RELOADING
    if retried:
        return Opening.QUIET
    return Opening.PREFETCHING if remote else Opening.LOADING


def shows_progress(shown: bool, progress: DownloadProgress) -> bool:
    """Whether a download's ``progress`` is reported: always once ``Prefetching`` is shown;
    before (a retry, a reload) only once bytes flow (``rate_bytes_per_second`` > 0) — a
    download resumed from complete files on disk shows nothing."""
    return shown or progress.rate_bytes_per_second > 0


def known_estimate(rec: Record, spec: Spec) -> int:
    """``spec``'s memory estimate (bytes) as far as the agent knows it before reading its
    files — from its last load or failed attempt at ``rec``'s key — else 0."""
    loaded, failure = rec.loaded, rec.failure
    if loaded is not None and loaded.spec == spec and loaded.estimated_bytes:
        return loaded.estimated_bytes
    return failure.estimated_bytes if failure is not None and failure.spec == spec else 0


def failed(previous: Failure | None, spec: Spec, reason: str, message: str, now: float, *,
           backoff: tuple[float, float], estimated_bytes: int = 0) -> Failure:
    """The failure of a load of ``spec`` at ``now``: attempt 1, or one more than ``previous``
    of the same spec; retried after ``initial × 2^(attempts−1)`` seconds capped at ``maximum``
    (``backoff``; defaults :data:`~.state.RETRY_INITIAL_BACKOFF`,
    :data:`~.state.RETRY_MAX_BACKOFF`), the message saying so — unless ``reason`` is
    permanent (:data:`~.state.PERMANENT_REASONS`: never retried, ``retry_at`` None)."""
    attempts = previous.attempts + 1 if previous is not None and previous.spec == spec else 1
    if reason in PERMANENT_REASONS:
        return Failure(spec, reason, message, attempts, None, estimated_bytes)
    initial, maximum = backoff
    delay = min(initial * 2 ** (attempts - 1), maximum)
    return Failure(spec, reason, f"{message} (attempt {attempts}; retrying in {delay:g}s)",
                   attempts, now + delay, estimated_bytes)


# -- memory and the model limit ----------------------------------------------------------------
def in_use(records: Mapping[str, Record], core: CoreView,
           exclude: str | None = None) -> tuple[int, dict[str, int]]:
    """Memory the node's resident revisions hold, as the serving core accounts it:
    ``(total bytes, {assignment key: bytes})``. A revision loaded for a key holds
    ``max(its estimate, its memory_bytes)`` — the estimate reserves its KV cache at the
    assignment's limits, the core's figure is its parameters plus its prompt cache now; any
    other revision in the core (one draining) its ``memory_bytes``; a revision the core is
    loading now its estimate. ``exclude``: a key left out (the one about to be (re)loaded)."""
    held: dict[str, int] = {}
    tracked: set[Ident] = set()
    for key, rec in records.items():
        loaded = rec.loaded
        if loaded is None or loaded.standby or loaded.spec.ident not in core.serving:
            continue
        tracked.add(loaded.spec.ident)
        if key != exclude:
            held[key] = max(loaded.estimated_bytes, core.memory.get(loaded.spec.ident, 0))
    other = sum(b for ident, b in core.memory.items() if ident not in tracked)
    other += sum(rec.loading[1] for key, rec in records.items()
                 if rec.loading is not None and key != exclude and key not in held)
    return sum(held.values()) + other, held


def resident_count(records: Mapping[str, Record], core: CoreView, own: Ident) -> int:
    """Revisions resident in the core (draining ones included) or being loaded, ``own`` (the
    one about to be (re)loaded) left out."""
    idents = set(core.memory)
    idents.update(rec.loading[0].ident for rec in records.values() if rec.loading is not None)
    idents.discard(own)
    return len(idents)


def model_uses(records: Mapping[str, Record], held: Mapping[str, int],
               in_flight: Mapping[Ident, int], now: float) -> dict[str, ModelUse]:
    """Assignment key → the lifecycle facts of each resident revision (``held``, from
    :func:`in_use`) that is assigned as loaded and whose key is not busy (locked). A revision
    with requests in flight (``in_flight``) counts as used at ``now``."""
    uses: dict[str, ModelUse] = {}
    for key, rec in records.items():
        loaded = rec.loaded
        if loaded is None or loaded.standby or key not in held or rec.lock.locked():
            continue
        d = rec.assigned(loaded.spec)
        if d is None:
            continue
        n = in_flight.get(loaded.spec.ident, 0)
        uses[key] = ModelUse(key, now if n else loaded.last_used, n,
                             d.lifecycle.idle_unload_seconds, pinned=d.lifecycle.pinned,
                             resident_bytes=held[key])
    return uses


@dataclasses.dataclass(frozen=True)
class RoomObservation:
    """What :func:`room` looks at before a load: ``budget_bytes`` (None: no budget) and
    ``max_loaded_models`` (0: no limit) of the node; ``need``: the load's estimate; ``used`` /
    ``held``: :func:`in_use` without the key; ``resident``: :func:`resident_count` without the
    revision; ``uses``: the other keys' :func:`model_uses` (the eviction candidates)."""

    budget_bytes: int | None
    max_loaded_models: int
    need: int
    used: int = 0
    held: Mapping[str, int] = dataclasses.field(default_factory=dict)
    resident: int = 0
    uses: tuple[ModelUse, ...] = ()


@dataclasses.dataclass(frozen=True)
class Room:
    """:func:`room`'s answer: fits (nothing set), ``evict`` these keys to standby first
    (``cause`` goes into their reports) and look again, or ``refuse`` with that failure reason
    (:data:`~.state.INSUFFICIENT_MEMORY`, :data:`~.state.MODEL_LIMIT`) and ``message``."""

    evict: tuple[str, ...] = ()
    cause: str = ""
    refuse: str | None = None
    message: str = ""


def room(spec: Spec, obs: RoomObservation, now: float, *, evict: bool,
         evicted: bool = False) -> Room:
    """Whether loading ``spec`` fits: its estimate within what ``used`` leaves of the budget,
    and one more resident revision within ``max_loaded_models``. If not, and ``evict`` (a
    prefetch never evicts) and nothing was evicted for it yet (``evicted``): the idle,
    unpinned keys with nothing in flight to evict, least recently used first, both constraints
    at once (:func:`~node_agent.lifecycle.evictions`). Else refused with the numbers:
    :data:`~.state.INSUFFICIENT_MEMORY` when memory is what fails (unless evicting would have
    satisfied memory alone), else :data:`~.state.MODEL_LIMIT`. No budget and no limit: fits."""
    budget, limit = obs.budget_bytes, obs.max_loaded_models
    if budget is None and not limit:
        return Room()
    free, needed = (0, 0) if budget is None else (budget - obs.used, obs.need)
    count = obs.resident
    if needed <= free and (not limit or count < limit):
        return Room()
    victims: list | None = None
    uses = obs.uses if evict else ()
    if evict and not evicted:
        victims = evictions(uses, needed, free, now, max_loaded_models=limit, resident=count)
        if victims:
            if needed > free:
                why = (f"needs {format_bytes(obs.need)}; {format_bytes(max(free, 0))} free of "
                       f"the node's budget {format_bytes(budget)}")
            else:
                why = (f"{count} of the node's limit of {limit} loaded models "
                       "(--max-loaded-models) are resident")
            return Room(evict=tuple(victims),
                        cause=f"{spec.model_id} revision {spec.revision} ({why})")
    blockers = ("cannot be evicted (pinned by minReady, serving requests or busy)" if evict
                else "a prefetch does not evict")
    memory_fails = needed > free and (
        evicted or victims is not None or evictions(uses, needed, free, now) is None)
    if memory_fails:
        return Room(refuse=INSUFFICIENT_MEMORY, message=(
            f"{spec.model_id} revision {spec.revision} needs {format_bytes(obs.need)} "
            f"({obs.need} bytes) but only {format_bytes(max(free, 0))} of the node's budget "
            f"{format_bytes(budget)} is free: {format_bytes(obs.used)} is held by "
            f"{len(obs.held)} resident revision(s) that {blockers}"))
    return Room(refuse=MODEL_LIMIT, message=(
        f"{spec.model_id} revision {spec.revision} would be loaded model {count + 1} but "
        f"the node's limit is {limit} (--max-loaded-models): {count} revision(s) are "
        f"resident or loading that {blockers}"))


# -- idle unload, eviction, prefetch, reload on demand ------------------------------------------
def may_unload(rec: Record, loaded: Loaded, reason: str, in_flight: int,
               now: float) -> Assignment | None:
    """The assignment under which ``loaded`` may go to standby now (None: it no longer
    qualifies): still ``rec``'s loaded revision and assigned as such, not pinned, nothing in
    flight; for an idle unload (``reason`` :data:`~mlx_fleet.contract.IDLE_UNLOADED`) also
    idle for its ``idle_unload_seconds`` (0 = never). An eviction needs no idleness."""
    d = rec.assigned(loaded.spec)
    if rec.loaded is not loaded or d is None or d.lifecycle.pinned or in_flight:
        return None
    if reason == IDLE_UNLOADED and (d.lifecycle.idle_unload_seconds <= 0 or
                                    now - loaded.last_used < d.lifecycle.idle_unload_seconds):
        return None
    return d


def prefetches(records: Mapping[str, Record], history: UsageHistory, now: float, *,
               core: CoreView, reloading: Iterable[Ident], allowance: int, window_s: float,
               budget_bytes: int | None, max_loaded_models: int
               ) -> tuple[list[tuple[str, Ident]], list[tuple[Ident, str]]]:
    """The predictive prefetch at ``now``: ``(to start, skipped)``. Candidates are the standby
    revisions still assigned as such, not being reloaded (``reloading``) and whose key is not
    busy; :func:`~node_agent.lifecycle.predict_prefetch` picks at most ``allowance`` whose next
    request is expected within ``window_s``; each is started — ``(key, ident)`` — only if it
    leaves the node within ``max_loaded_models`` and its last estimate fits what is free of
    ``budget_bytes`` after the ones started before it (a prefetch never evicts); the others
    are ``(ident, why)`` in ``skipped``."""
    if allowance <= 0:
        return [], []
    busy = set(reloading)
    standby: dict[Ident, str] = {}
    for key, rec in records.items():
        loaded = rec.loaded
        if (loaded is not None and loaded.standby and rec.assigned(loaded.spec) is not None
                and loaded.spec.ident not in busy and not rec.lock.locked()):
            standby[loaded.spec.ident] = key
    if not standby:
        return [], []
    started: list[tuple[str, Ident]] = []
    skipped: list[tuple[Ident, str]] = []
    reserved = 0
    for predicted in predict_prefetch(history, now, unloaded=standby, window_s=window_s,
                                      max_prefetches=allowance):
        ident: Ident = predicted  # type: ignore[assignment]  (the keys of ``standby``)
        key = standby[ident]
        loaded = records[key].loaded
        assert loaded is not None
        limit = max_loaded_models
        if limit and resident_count(records, core, loaded.spec.ident) + len(started) >= limit:
            skipped.append((ident, f"the node's limit of {limit} loaded models is reached "
                                   "(a prefetch does not evict)"))
            continue
        if budget_bytes is not None:
            free = budget_bytes - in_use(records, core, exclude=key)[0] - reserved
            if loaded.estimated_bytes > free:
                skipped.append((ident, f"its estimate {format_bytes(loaded.estimated_bytes)} "
                                       f"does not fit the {format_bytes(max(free, 0))} free "
                                       "(a prefetch does not evict)"))
                continue
        reserved += loaded.estimated_bytes
        started.append((key, ident))
    return started, skipped


class Admission(str, enum.Enum):
    """How a request for a revision is let in (:func:`admit`)."""

    READY = "Ready"            # resident: go on (a use)
    NOT_SERVED = "NotServed"   # not served here (ModelNotLoaded)
    OVERLOADED = "Overloaded"  # too many wait for its reload (429, ``retry_after``)
    START = "Start"            # standby: start its reload (single flight) and wait for it
    JOIN = "Join"              # its reload runs: wait for it


@dataclasses.dataclass(frozen=True)
class Admit:
    """:func:`admit`'s answer; ``key``: the assignment key of the revision (START);
    ``retry_after``: whole seconds (OVERLOADED)."""

    admission: Admission
    key: str = ""
    retry_after: int = 0


def admit(records: Mapping[str, Record], ident: Ident, *, serving: bool, reloading: bool,
          waiting: int, max_waiters: int) -> Admit:
    """A request for ``ident``: resident and ``serving`` → READY; its reload runs
    (``reloading``) → JOIN; in standby → START; neither → NOT_SERVED. Joining or starting when
    ``max_waiters`` requests already wait (``waiting``) → OVERLOADED, retry after the last
    load's duration (at least 1 s)."""
    found = next(((k, r.loaded) for k, r in records.items()
                  if r.loaded is not None and r.loaded.spec.ident == ident), None)
    if not reloading and (found is None or not found[1].standby):
        if found is not None and serving:
            return Admit(Admission.READY, found[0])
        return Admit(Admission.NOT_SERVED)
    if waiting >= max_waiters:
        seconds = found[1].load_seconds if found is not None else 0.0
        return Admit(Admission.OVERLOADED, retry_after=max(1, math.ceil(seconds)))
    if reloading:
        return Admit(Admission.JOIN)
    assert found is not None
    return Admit(Admission.START, found[0])


@dataclasses.dataclass(frozen=True)
class Retire:
    """What retiring a key (no longer assigned) drops: ``let_go`` its loaded revision (drain
    it, or forget it in standby), ``forget`` the series of the spec it last attempted (unless
    that revision drains: the drain forgets it once done), ``delete_report``."""

    let_go: Loaded | None
    forget: Spec | None
    delete_report: bool


def retire(rec: Record, draining: Iterable[Ident]) -> Retire:
    """What retiring ``rec``'s key drops (see :class:`Retire`); the revision its let-go
    drains counts as draining."""
    tried = rec.attempted
    draining = {*draining, *_drained_by(rec.loaded)}
    return Retire(rec.loaded,
                  tried if tried is not None and tried.ident not in draining else None,
                  rec.reported or rec.loaded is not None)


def holds(records: Mapping[str, Record], ident: Ident) -> bool:
    """Some key has ``ident`` loaded or in standby (its series and history stay)."""
    return any(r.loaded is not None and r.loaded.spec.ident == ident for r in records.values())


# -- views for the HTTP side --------------------------------------------------------------------
def served(records: Mapping[str, Record]) -> dict[str, ServedModel]:
    """served model name → its deployment and the revisions it serves: those loaded now (not
    draining) and those in standby (reloaded on demand), for keys still assigned."""
    deps: dict[str, tuple[str, str]] = {}
    revisions: dict[str, dict[str, Role]] = {}
    standby: dict[str, set[str]] = {}
    for rec in records.values():
        d, loaded = rec.desired, rec.loaded
        if loaded is None or not isinstance(d, Assignment):
            continue
        model = loaded.spec.model_id
        deps.setdefault(model, (d.namespace, d.name))
        revisions.setdefault(model, {})[loaded.spec.revision] = d.role
        if loaded.standby:
            standby.setdefault(model, set()).add(loaded.spec.revision)
    return {m: ServedModel(*deps[m], revisions[m], frozenset(standby.get(m, ())))
            for m in revisions}


def standby_models(records: Mapping[str, Record]) -> list[StandbyModel]:
    """The revisions assigned here that are not resident (idle-unloaded, evicted, or
    ``OnDemand`` and not loaded yet), ordered by model id and revision."""
    out = []
    for rec in records.values():
        loaded = rec.loaded
        if loaded is not None and loaded.standby and rec.assigned(loaded.spec) is not None:
            out.append(StandbyModel(loaded.spec.model_id, loaded.spec.revision,
                                    loaded.spec.max_context_tokens, loaded.reason,
                                    int(loaded.created_unix), loaded.capabilities))
    return sorted(out, key=lambda m: (m.model_id, m.revision))

