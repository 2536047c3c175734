"""Converge the serving core onto this node's assignments, and report per-assignment state.

Desired state: every key under ``keys.node_assignments_prefix(node)``, followed with
:func:`mlx_fleet.store.follow_prefix` (a snapshot *replaces* the desired set, events update it;
the watch resumes from the last revision seen and re-lists after a compaction, so no change is
ever skipped).

Actual state: the models this controller loaded into the :class:`~node_agent.serving.ServingCore`,
one per assignment key — that is per (deployment, revision): two revisions of one served model
(a rolling update's surge, a canary's stable and candidate) are both resident, each its own
entry in the core's registry. :meth:`Controller.served` tells the HTTP layer which revisions of
each served model are loaded and in which :class:`~mlx_fleet.contract.Role`.

Converging is concurrent per assignment key: each key gets a task of its own (download → check
→ load → report), so a slow download never holds up another assignment's load, unload or
unassignment. A converge worker only plans — :func:`~node_agent.lifecycle.plan_convergence`, a
plain function over each key's state — and cancels and starts the keys' tasks; it never waits
for a download or a load. A key's task whose target changes (source URI, serving limits, served
name) or that is unassigned is cancelled (a download stops at once, its partial files stay for a
resume; a load the core was reading is called off) and a new task takes over once it has ended:
it loads the new target, or *retires* the key — a revision that is no longer assigned (or whose
model name changed) is *drained* in the background: it stops taking new requests at once, its
running requests finish (up to :data:`DRAIN_SECONDS`), then it is unloaded; so removing the
previous revision of a rolling update fails no request — and its report is deleted. A change of
``generation`` or ``role`` lets a running task finish and is reported after it (a changed
``role`` is never a reload: promotion is free). One lock per key: a key's tasks, its idle unload
and its reload on demand never interleave. The serving core queues loads and materialises one
at a time; downloads, header checks and reports overlap.

Reports (:class:`~mlx_fleet.contract.AssignmentReport` at
``keys.report(node, ns, name, revision)``) are written through
:class:`~node_agent.registration.Registration`, bound to its lease: ``Loading`` → ``Ready``
(``endpoint`` = the agent's advertised URL, ``resident_bytes`` = the weights' bytes from the
safetensors headers, ``estimated_bytes`` = weights + KV cache at the assignment's limits,
:mod:`node_agent.memory_estimate`, carried by every report once known, Loading, Prefetching and
Failed ones included) or ``Failed`` (``reason``/``message`` from
:class:`~node_agent.serving.ModelLoadError`, :class:`~node_agent.sources.SourceError` or
:class:`~node_agent.memory_estimate.ModelFileError` — a hostile or malformed safetensors header
or ``config.json`` is refused before anything is loaded). The
report is deleted when the assignment goes away. A malformed assignment value is logged and
reported ``Failed``/``InvalidAssignment``; it never stops the controller.

A failed load is retried, per assignment, with a capped exponential back-off
(:data:`RETRY_INITIAL_BACKOFF` doubling to :data:`RETRY_MAX_BACKOFF`; the converge worker starts
the key's task again when its retry is due), because the cause is often transient: a model disk not
mounted yet (``ModelNotFound``), memory still held by another process (``LoadFailed``). While it
retries the report stays ``Failed`` (no ``Loading`` flicker); its message carries the attempt
count and the next delay, and a successful retry reports ``Ready``. Failures no retry can fix
(:data:`PERMANENT_REASONS`: the URI or the assignment itself is wrong) wait for a spec change,
which is always tried at once.

Idle unload and reload on demand (:mod:`.lifecycle`): every request served here calls
:meth:`Controller.touch`; a *lifecycle* task looks every :data:`LIFECYCLE_INTERVAL_SECONDS` at
each loaded revision (a revision with requests in flight counts as used now) and unloads those
idle for their assignment's ``lifecycle.idle_unload_seconds`` (0 = never;
:func:`~node_agent.lifecycle.idle_unloads`). The unload drops every reference the core holds,
runs ``gc`` and ``mx.clear_cache()``; MLX's active + cache memory and the process RSS are
measured before and after (:meth:`~node_agent.serving.ServingCore.memory_usage`) and reported:
``Unloaded``/``IdleUnloaded`` with ``freed_bytes``, ``resident_bytes`` 0 and the numbers in the
message. The revision stays assigned and is still listed by :meth:`Controller.served`, as
*standby*, so routing still picks it; :meth:`Controller.ensure_loaded` reloads it when a request
arrives (one reload however many requests wait — at most :data:`MAX_RELOAD_WAITERS`, then
:class:`~node_agent.serving.Overloaded` — reported ``Loading`` then ``Ready``). A reload that
fails reports ``Failed`` and is retried like any failed load.

A *pinned* revision (``lifecycle.pinned``: the deployment's ``minReady``) is never unloaded to
standby. Under memory pressure (``budget_bytes``, :meth:`Controller._make_room`) a load first
evicts idle, unpinned revisions least recently used first (:func:`~node_agent.lifecycle.evictions`)
to the same standby, reported ``Unloaded``/``Evicted``; when that is not enough the load fails
:data:`INSUFFICIENT_MEMORY` with the numbers. The node's limit on loaded models
(``max_loaded_models``, the agent's ``--max-loaded-models``; 0 = none) is enforced the same way
before every load, reload and prefetch: when one more resident revision would exceed it, idle,
unpinned revisions with nothing in flight are evicted least recently used first, else the load
fails :data:`MODEL_LIMIT` with the numbers; both failures are retried like any failed load.
Each lifecycle pass (:meth:`Controller.tick`) also runs the predictive prefetch
(:meth:`Controller.prefetch`) over the requests' arrivals recorded by :meth:`Controller.touch`,
and sets the lifecycle metrics. ``lifecycle.prefetch: OnDemand``
loads nothing until the first request: the revision starts in standby
(``Unloaded``/``AwaitingRequest``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from mlx_fleet.contract import (AWAITING_REQUEST, EVICTED, IDLE_UNLOADED, PREDICTIVE_PREFETCH,
                                PREFETCH_ON_DEMAND, RELOADING_ON_DEMAND, Assignment,
                                AssignmentReport,
                                AssignmentState, DownloadProgress, Keys, Role)
from mlx_fleet.quantity import format_bytes
from mlx_fleet.store import KV, Snapshot, Store, WatchEvent, follow_prefix

from mlx_fleet.supervise import Supervised

from .lifecycle import (DEFAULT_MAX_PREFETCHES, DEFAULT_PREFETCH_WINDOW_SECONDS, KeyState,
                        ModelUse, UsageHistory, evictions, idle_unloads, plan_convergence,
                        predict_prefetch)
from . import memory_estimate
from .registration import Registration
from .serving import MemoryUsage, ModelLoadError, ModelNotLoaded, Overloaded, ServingCore
from .serving.errors import LOAD_CANCELLED
from .fetch import default_model_cache, fetch
from .sources import SourceError, is_remote, resolve_source

log = logging.getLogger(__name__)

__all__ = ["Controller", "ServedModel", "IdleUnload", "StandbyModel", "RETRY_INITIAL_BACKOFF",
           "RETRY_MAX_BACKOFF", "PERMANENT_REASONS", "DRAIN_SECONDS",
           "LIFECYCLE_INTERVAL_SECONDS", "MAX_RELOAD_WAITERS", "INSUFFICIENT_MEMORY",
           "MODEL_LIMIT", "LOAD_ASSIGNED", "UNLOAD_UNASSIGNED"]

#: Delay before the first retry of a failed load, in seconds; it doubles with every failure.
#: Short, so a replica whose disk was a moment late comes up quickly.
RETRY_INITIAL_BACKOFF = 2.0
#: Cap of the retry delay (5 minutes): a load that keeps failing (each attempt reads config and
#: maybe gigabytes of weights) must not hammer the disk or the logs, yet recovers within minutes
#: of the cause going away, without anyone touching the assignment.
RETRY_MAX_BACKOFF = 300.0
#: Failure reasons that only a change of the assignment can fix: not retried.
PERMANENT_REASONS = frozenset({"InvalidSource", "UnsupportedSource", "InvalidAssignment"})
#: Least interval between two Prefetching reports of one download (seconds).
_PROGRESS_REPORT_SECONDS = 0.5
#: How long an unassigned revision may finish its running requests before it is unloaded
#: (seconds). Generous: a long completion on a loaded Mac can take a minute.
DRAIN_SECONDS = 60.0
#: How often the lifecycle task looks for idle revisions (seconds): an idle unload happens at
#: most this late.
LIFECYCLE_INTERVAL_SECONDS = 1.0
#: Requests that may wait for one revision's reload on demand; one more gets
#: :class:`~node_agent.serving.Overloaded` (429 with ``Retry-After``).
MAX_RELOAD_WAITERS = 32
#: Failure reason of a load whose estimate does not fit the node's budget even after evicting
#: every idle, unpinned revision (the message gives the numbers). Retried: memory frees up.
INSUFFICIENT_MEMORY = "InsufficientMemory"
#: Failure reason of a load that would leave more revisions resident than the node's
#: ``max_loaded_models`` even after evicting every idle, unpinned revision (the message gives
#: the numbers). Retried: a request finishes, a pin is lifted, an assignment goes away.
MODEL_LIMIT = "ModelLimit"
#: ``reason`` label of a load for an assignment (first load, spec change, retry), next to the
#: standby reloads' :data:`~mlx_fleet.contract.RELOADING_ON_DEMAND` and
#: :data:`~mlx_fleet.contract.PREDICTIVE_PREFETCH`.
LOAD_ASSIGNED = "Assigned"
#: ``reason`` label of an unload because the revision is no longer assigned here, next to
#: :data:`~mlx_fleet.contract.IDLE_UNLOADED` and :data:`~mlx_fleet.contract.EVICTED`.
UNLOAD_UNASSIGNED = "Unassigned"


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """A served model name on this node: its deployment and the revisions it serves → role.
    ``standby``: those of them that are not resident — unloaded for idleness, evicted, or
    ``OnDemand`` and not loaded yet (a request loads them first,
    :meth:`Controller.ensure_loaded`); the others are resident."""

    namespace: str
    name: str
    revisions: dict[str, Role]
    standby: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True)
class IdleUnload:
    """One unload of a revision to standby: ``reason`` ``IdleUnloaded`` (no request for
    ``idle_seconds`` ≥ its policy's ``idle_unload_seconds``) or ``Evicted`` (to make room for
    the load ``cause`` names, with the numbers); memory ``before`` and ``after`` it (None when
    it could not be measured), ``freed_bytes``: MLX active + cache bytes before − after (≥ 0)."""

    model_id: str
    revision: str
    idle_seconds: float
    idle_unload_seconds: int
    before: MemoryUsage | None
    after: MemoryUsage | None
    freed_bytes: int
    reason: str = IDLE_UNLOADED
    cause: str = ""

    def message(self) -> str:
        if self.reason == EVICTED:
            text = (f"evicted after {self.idle_seconds:.0f}s without a request (least recently "
                    f"used) to make room for {self.cause}: unloaded, memory returned")
        else:
            text = (f"no request for {self.idle_seconds:.0f}s (idleUnloadSeconds "
                    f"{self.idle_unload_seconds}): unloaded, memory returned")
        if self.before is not None and self.after is not None:
            b, a = self.before, self.after
            text += (f"; MLX active+cache {format_bytes(b.mlx_bytes)} -> "
                     f"{format_bytes(a.mlx_bytes)} (freed {self.freed_bytes} bytes), process "
                     f"RSS {format_bytes(b.rss_bytes)} -> {format_bytes(a.rss_bytes)}")
        return text + "; the next request reloads it"


@dataclasses.dataclass(frozen=True)
class StandbyModel:
    """A revision assigned here but not resident (``GET /v1/models`` lists it): ``reason`` is
    its report's (``IdleUnloaded``, ``Evicted``, ``AwaitingRequest``); ``created_unix``: when it
    was last loaded or assigned (seconds since the epoch)."""

    model_id: str
    revision: str
    max_context_tokens: int
    reason: str
    created_unix: int


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Everything about an assignment that determines what is loaded; a change reloads."""

    model_id: str
    uri: str
    revision: str
    max_concurrent_sequences: int
    max_context_tokens: int

    @classmethod
    def of(cls, a: Assignment) -> _Spec:
        return cls(a.served_model_name, a.source.uri, a.source.revision,
                   a.serving.max_concurrent_sequences, a.serving.max_context_tokens)


@dataclasses.dataclass(frozen=True)
class _Invalid:
    """An assignment key whose value could not be parsed."""

    namespace: str
    name: str
    generation: int
    message: str


@dataclasses.dataclass(frozen=True)
class _Failure:
    """The latest failed load of an assignment's spec."""

    spec: _Spec
    reason: str
    message: str           # the report's message (with attempt count and next retry)
    attempts: int
    retry_at: float | None  # monotonic time of the next attempt; None: not retried
    estimated_bytes: int = 0  # the revision's memory estimate, when the agent knows it


#: ``done`` of a key that is not assigned and has something left (a report, a failure), so
#: that the converge plan retires it.
_RESIDUE = object()


@dataclasses.dataclass
class _Loaded:
    """A revision this controller loaded (or holds in standby) for an assignment.
    ``last_used``: clock time of its last request (or of its load); ``standby``: not resident
    — unloaded since (``unload`` says how) or never loaded (``OnDemand``: ``standby_reason``
    ``AwaitingRequest``) — still served on demand; ``load_seconds``: how long its last load
    took."""

    spec: _Spec
    resident_bytes: int
    last_used: float = 0.0
    standby: bool = False
    estimated_bytes: int = 0  # weights + KV cache at the assignment's limits (memory_estimate)
    unload: IdleUnload | None = None
    load_seconds: float = 0.0
    standby_reason: str = ""
    created_unix: float = dataclasses.field(default_factory=time.time)


class Controller:
    """Keeps ``core`` serving exactly ``node_name``'s assignments.

    ``store``/``keys``: the etcd store and contract layout; ``registration``: writes the reports
    under the node's lease; ``advertise_url``: the ``endpoint`` put into Ready reports;
    ``resolve``: local source URI → local path (default
    :func:`~node_agent.sources.resolve_source`; ``hf://`` and ``https://`` sources are fetched
    with :func:`~node_agent.fetch.fetch`).
    ``retry_backoff``: ``(initial, maximum)`` delay in seconds between retries of a failed load
    (default :data:`RETRY_INITIAL_BACKOFF`, :data:`RETRY_MAX_BACKOFF`). ``model_cache``: where
    ``https://`` sources are downloaded (default :func:`~node_agent.fetch.default_model_cache`,
    ``$MLX_FLEET_CACHE/models``); ``hf://`` ones use the Hugging Face cache.
    ``lifecycle_interval``: seconds between two looks for idle revisions (default
    :data:`LIFECYCLE_INTERVAL_SECONDS`); ``max_reload_waiters``: requests that may wait for one
    reload (default :data:`MAX_RELOAD_WAITERS`); ``clock``: monotonic seconds for idle times
    and the usage history (injectable for tests). ``budget_bytes``: memory the node's resident
    revisions may take (the agent passes its capacity's
    :meth:`~mlx_fleet.contract.NodeCapacity.budget_bytes`, with its ``--memory-watermark``;
    None: no check, no eviction). ``prefetch_window_seconds`` / ``max_prefetches``: the predictive prefetch's
    window and the most reloads it runs at once (:mod:`.lifecycle`, seed 001: 30 s, 2).
    ``max_loaded_models``: the most revisions resident at once (seed 004: "Per-worker max
    loaded models: 2"; default 0 = no limit but memory); raises ``ValueError`` when negative.
    """

    def __init__(self, store: Store, keys: Keys, *, node_name: str, core: ServingCore,
                 registration: Registration, advertise_url: str,
                 resolve: Callable[[str], Path] = resolve_source,
                 retry_backoff: tuple[float, float] = (RETRY_INITIAL_BACKOFF,
                                                       RETRY_MAX_BACKOFF),
                 model_cache: Path | None = None,
                 lifecycle_interval: float = LIFECYCLE_INTERVAL_SECONDS,
                 max_reload_waiters: int = MAX_RELOAD_WAITERS,
                 clock: Callable[[], float] = time.monotonic,
                 budget_bytes: int | None = None,
                 prefetch_window_seconds: float = DEFAULT_PREFETCH_WINDOW_SECONDS,
                 max_prefetches: int = DEFAULT_MAX_PREFETCHES,
                 max_loaded_models: int = 0) -> None:
        if max_loaded_models < 0:
            raise ValueError(f"max_loaded_models must be >= 0 (0 = no limit), "
                             f"got {max_loaded_models}")
        self._store = store
        self._keys = keys
        self.node_name = node_name
        self.prefix = keys.node_assignments_prefix(node_name)
        self._core = core
        self._reg = registration
        self.advertise_url = advertise_url
        self._resolve = resolve
        self._retry_initial, self._retry_max = retry_backoff
        self._model_cache = model_cache if model_cache is not None else default_model_cache()
        self._desired: dict[str, Assignment | _Invalid] = {}
        self._loaded: dict[str, _Loaded] = {}
        self._failed: dict[str, _Failure] = {}
        self._reported: set[str] = set()            # assignment keys with a report written
        self._draining: dict[tuple[str, str], asyncio.Task] = {}  # (model id, revision)
        self._changed = asyncio.Event()
        self._lifecycle_interval = lifecycle_interval
        self.max_reload_waiters = max_reload_waiters
        self._clock = clock
        self.budget_bytes = budget_bytes
        self.max_loaded_models = max_loaded_models
        self._prefetch_window = prefetch_window_seconds
        self._max_prefetches = max_prefetches
        self._metrics = core.metrics
        #: Request arrivals per served (model id, revision), for the predictive prefetch.
        self.history = UsageHistory()
        self._prefetches: set[asyncio.Task] = set()
        self._observing: asyncio.Task | None = None
        self._loading: dict[str, int] = {}  # assignment key → estimate, while the core loads it
        self._loading_ids: dict[str, tuple[str, str]] = {}  # same keys → (model id, revision)
        self._quiet = asyncio.Event()  # set while no key's task runs and nothing is pending
        # One task per assignment key (lifecycle.plan_convergence): key → (the target it
        # works towards, None when it retires the key; the task)
        self._key_tasks: dict[str, tuple[_Spec | _Invalid | None, asyncio.Task]] = {}
        self._done: dict[str, Assignment | _Invalid] = {}  # what each key's last task reached
        self._conflicts: set[str] = set()  # keys refused with ModelNameConflict
        self._claims: dict[str, str] = {}  # key → served name, while its task loads it
        self._attempted: dict[str, _Spec] = {}  # key → the spec its tasks last tried to load
        self._bug: BaseException | None = None  # of a key's task; raised by the next pass
        # One lock per assignment key: a load, an idle unload, a reload and converging one
        # assignment never interleave (the lifecycle task skips a key that is busy).
        self._locks: dict[str, asyncio.Lock] = {}
        self._reloads: dict[tuple[str, str], asyncio.Task] = {}   # (model id, revision)
        self._reload_waiters: dict[tuple[str, str], int] = {}
        # All run under supervision: a bug (e.g. in a watch callback) is logged and the task
        # restarts after a back-off; a restarted follower re-lists, so nothing is missed.
        self._tasks = [
            Supervised("controller:follow", lambda: follow_prefix(
                self._store, self.prefix, self._on_snapshot, self._on_event)),
            Supervised("controller:converge", self._worker),
            Supervised("controller:lifecycle", self._lifecycle),
        ]
        #: Number of snapshots (initial list + re-lists after compaction) applied.
        self.snapshots = 0
        #: Number of passes of the lifecycle task (idle checks) completed.
        self.lifecycle_passes = 0
        #: Number of reloads on demand started (single-flight: one per standby period).
        self.reloads = 0
        #: The latest idle unload of each (model id, revision).
        self.idle_unloaded: dict[tuple[str, str], IdleUnload] = {}
        #: The latest eviction (unload under memory pressure) of each (model id, revision).
        self.evicted: dict[tuple[str, str], IdleUnload] = {}
        #: Number of predictive prefetches (reloads ahead of a predicted request) started.
        self.prefetches = 0

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Start following assignments and the converge worker (returns at once)."""
        for t in self._tasks:
            t.start()

    async def stop(self) -> None:
        """Stop following and converging. Loaded models stay loaded (the core owns them)."""
        for t in self._tasks:
            await t.stop()
        running = [t for _, t in self._key_tasks.values()]
        for t in running:
            t.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        for t in self._draining.values():
            t.cancel()
        for t in list(self._reloads.values()):
            t.cancel()
        for t in [*self._prefetches, self._observing]:
            if t is not None:
                t.cancel()

    async def converged(self) -> None:
        """Return once every assignment's task has ended and the converge worker has planned
        over the desired state it has seen and waits for a change (failed loads may be
        waiting for their retry). A change that arrives later starts new tasks."""
        await self._quiet.wait()

    def served(self) -> dict[str, ServedModel]:
        """served model name → its deployment and the revisions it serves: those loaded now
        (not draining) and those unloaded for idleness (``standby``: reloaded on demand)."""
        deps: dict[str, tuple[str, str]] = {}
        revisions: dict[str, dict[str, Role]] = {}
        standby: dict[str, set[str]] = {}
        for key, loaded in self._loaded.items():
            d = self._desired.get(key)
            if not isinstance(d, Assignment):
                continue
            model = loaded.spec.model_id
            deps.setdefault(model, (d.namespace, d.name))
            revisions.setdefault(model, {})[loaded.spec.revision] = d.role
            if loaded.standby:
                standby.setdefault(model, set()).add(loaded.spec.revision)
        return {m: ServedModel(*deps[m], revisions[m], frozenset(standby.get(m, ())))
                for m in revisions}

    def touch(self, model_id: str, revision: str) -> None:
        """A request for ``model_id`` revision ``revision`` is being served: it is not idle, and
        its arrival goes into the usage history (:meth:`prefetch`). Called once per request."""
        if self._mark_used(model_id, revision):
            self.history.record((model_id, revision), self._clock())

    def _mark_used(self, model_id: str, revision: str) -> bool:
        now = self._clock()
        found = False
        for loaded in self._loaded.values():
            if loaded.spec.model_id == model_id and loaded.spec.revision == revision:
                loaded.last_used = now
                found = True
        return found

    def standby_models(self) -> list[StandbyModel]:
        """The revisions assigned here that are not resident (idle-unloaded, evicted, or
        ``OnDemand`` and not loaded yet), ordered by model id and revision: a request loads
        them (``GET /v1/models`` lists them with ``status: standby``)."""
        out = []
        for key, loaded in self._loaded.items():
            d = self._desired.get(key)
            if loaded.standby and isinstance(d, Assignment) and _Spec.of(d) == loaded.spec:
                out.append(StandbyModel(loaded.spec.model_id, loaded.spec.revision,
                                        loaded.spec.max_context_tokens,
                                        self._standby_reason(loaded),
                                        int(loaded.created_unix)))
        return sorted(out, key=lambda m: (m.model_id, m.revision))

    @property
    def tasks(self) -> list[Supervised]:
        """The supervised background tasks (follower, converge worker, lifecycle), for
        ``/health``."""
        return list(self._tasks)

    def states(self) -> dict[str, dict]:
        """Per-assignment state for ``/health``: ``{"ns/name": {model, revision, state,
        reason}}`` from the latest reports."""
        out: dict[str, dict] = {}
        for key in sorted(self._desired):
            parsed = self._keys.parse_assignment(key)
            report = self._reg.report(self._keys.report(*parsed)) if parsed else None
            d = self._desired[key]
            out[f"{parsed[1]}/{parsed[2]}/{parsed[3]}" if parsed else key] = {
                "model": d.served_model_name if isinstance(d, Assignment) else "",
                "revision": parsed[3] if parsed else "",
                "role": d.role.value if isinstance(d, Assignment) else "",
                "state": report.state.value if report else AssignmentState.PENDING.value,
                "reason": report.reason if report else "",
            }
        return out

    # -- desired state -----------------------------------------------------------------------
    def _parse(self, kv: KV) -> Assignment | _Invalid | None:
        parsed = self._keys.parse_assignment(kv.key)
        if parsed is None or parsed[0] != self.node_name:
            log.warning("ignoring key %s: not an assignment key of node %s", kv.key,
                        self.node_name)
            return None
        _, ns, name, revision = parsed
        try:
            a = Assignment.from_json(kv.value)
        except (ValidationError, ValueError) as e:
            generation = 0
            with contextlib.suppress(Exception):
                g = json.loads(kv.value).get("generation", 0)
                generation = g if isinstance(g, int) and g >= 0 else 0
            msg = f"cannot parse assignment {kv.key}: {e}".replace("\n", "; ")
            log.error("%s", msg)
            return _Invalid(ns, name, generation, msg[:1000])
        if (a.namespace, a.name, a.revision) != (ns, name, revision):
            msg = (f"assignment {kv.key} names {a.namespace}/{a.name} revision {a.revision} in "
                   f"its body, but {ns}/{name} revision {revision} in its key")
            log.error("%s", msg)
            return _Invalid(ns, name, a.generation, msg)
        if not a.served_model_name:
            return _Invalid(ns, name, a.generation, f"assignment {kv.key}: empty served_model_name")
        return a

    async def _on_snapshot(self, snap: Snapshot) -> None:
        desired: dict[str, Assignment | _Invalid] = {}
        for kv in snap.items:
            value = self._parse(kv)
            if value is not None:
                desired[kv.key] = value
        self._desired = desired
        self.snapshots += 1
        log.info("assignments of %s at revision %d: %d", self.node_name, snap.revision,
                 len(desired))
        self._signal()

    async def _on_event(self, ev: WatchEvent) -> None:
        if ev.type == "DELETE":
            if self._desired.pop(ev.kv.key, None) is not None:
                log.info("assignment %s removed", ev.kv.key)
        else:
            value = self._parse(ev.kv)
            if value is None:
                return
            self._desired[ev.kv.key] = value
            log.info("assignment %s changed (revision %d)", ev.kv.key, ev.kv.mod_revision)
        self._signal()

    # -- converging --------------------------------------------------------------------------
    def _signal(self) -> None:
        """Something changed (desired state, a key's task ended, a drain ended): the converge
        worker plans again; :meth:`converged` waits for that pass."""
        self._quiet.clear()
        self._changed.set()

    async def _worker(self) -> None:
        """Plan whenever something changes, or when a failed load's retry is due. A pass that
        raises is a bug: it ends this run, and the supervisor restarts it (with a back-off),
        which plans again; the keys' tasks keep running meanwhile."""
        self._changed.set()  # (re)started: a pass may have been cut short
        while True:
            self._changed.clear()
            wake_at = await self._converge()
            if not self._changed.is_set() and not self._key_tasks:
                self._quiet.set()
            if wake_at is None:
                await self._changed.wait()
            elif (retry_in := wake_at - time.monotonic()) > 0:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a
                # cancellation that arrives as the event is set, and stop() would hang
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(retry_in):
                        await self._changed.wait()

    async def _converge(self) -> float | None:
        """One pass of the converge worker: :func:`~.lifecycle.plan_convergence` over every
        key's state, then cancel and start the keys' tasks it names (nothing here waits for a
        download or a load). Returns the monotonic time of the next retry (None: none).
        Re-raises the exception of a key's task that failed with a bug."""
        if self._bug is not None:
            bug, self._bug = self._bug, None
            raise bug
        plan = plan_convergence(self._key_states(), time.monotonic())
        for key in plan.cancel:
            self._key_tasks[key][1].cancel()
        for key in plan.start:
            self._start_key(key)
        for key in set(self._locks) - self._desired.keys() - self._key_tasks.keys():
            if not self._locks[key].locked():
                del self._locks[key]
        return plan.wake_at

    @staticmethod
    def _target(d: Assignment | _Invalid | None) -> _Spec | _Invalid | None:
        """What a change of restarts ``d``'s task: its spec (an invalid value: itself)."""
        return _Spec.of(d) if isinstance(d, Assignment) else d

    def _key_states(self) -> dict[str, KeyState]:
        """Every assignment key this controller knows of → its :class:`~.lifecycle.KeyState`."""
        out: dict[str, KeyState] = {}
        for key in {*self._desired, *self._done, *self._key_tasks, *self._loaded,
                    *self._failed, *self._reported}:
            d = self._desired.get(key)
            target = self._target(d)
            task = self._key_tasks.get(key)
            f = self._failed.get(key)
            done = self._done.get(key)
            if d is None and done is None and task is None:
                done = _RESIDUE  # something left of it (a report, a failure): retire it
            out[key] = KeyState(
                desired=d, target=target, busy=task is not None,
                running=task[0] if task is not None else None, done=done,
                retry_at=f.retry_at if f is not None and f.spec == target else None)
        return out

    def _start_key(self, key: str) -> None:
        """Start ``key``'s task towards its desired state now (after its previous task, if
        one runs: that one has just been cancelled, or is retiring the key)."""
        d = self._desired.get(key)
        previous = self._key_tasks.get(key)
        task = asyncio.create_task(self._run_key(key, d, previous[1] if previous else None),
                                   name=f"converge {key}")
        self._key_tasks[key] = (self._target(d), task)
        self._quiet.clear()

        def ended(t: asyncio.Task) -> None:
            if self._key_tasks.get(key, (None, None))[1] is t:
                del self._key_tasks[key]
            if not t.cancelled() and (e := t.exception()) is not None:
                log.error("converging assignment %s failed", key, exc_info=e)
                self._bug = self._bug or e
            self._signal()

        task.add_done_callback(ended)

    async def _run_key(self, key: str, d: Assignment | _Invalid | None,
                       previous: asyncio.Task | None) -> None:
        """``key``'s task: bring it to ``d`` (None: retire it) under its lock, once its
        previous task has ended; record what it converged to."""
        if previous is not None:
            await asyncio.wait({previous})
        async with self._lock(key):
            if d is None:
                await self._retire(key)
                self._done.pop(key, None)
            elif await self._converge_one(key, d):
                self._done[key] = d
            else:
                self._done.pop(key, None)  # called off: the next pass starts it again

    async def _retire(self, key: str) -> None:
        """``key`` is no longer assigned: drain what it has loaded (in the background), forget
        its failure and delete its report (under its lock)."""
        loaded = self._loaded.pop(key, None)
        if loaded is not None:
            self._let_go(key, loaded, "removed")
        attempted = self._attempted.pop(key, None)
        if attempted is not None and (attempted.model_id, attempted.revision) not in \
                self._draining:  # (a drain forgets it once done)
            self._forget(attempted)  # e.g. a cancelled download's series (unless loaded)
        self._failed.pop(key, None)
        self._conflicts.discard(key)
        if key in self._reported or loaded is not None:
            await self._reg.delete_report(self._report_key(key))
        self._reported.discard(key)

    def _let_go(self, key: str, loaded: _Loaded, why: str) -> None:
        """``key`` no longer serves ``loaded`` (already removed from ``_loaded``): drain it, or
        forget it if it is in standby; an assignment refused for its name may now load."""
        if loaded.standby:  # unloaded already
            log.info("forgetting standby %s revision %s (assignment %s %s)",
                     loaded.spec.model_id, loaded.spec.revision, key, why)
            self._forget(loaded.spec)
        else:
            log.info("draining %s revision %s (assignment %s %s)", loaded.spec.model_id,
                     loaded.spec.revision, key, why)
            self._drain(loaded.spec)
        self._recheck_conflicts()

    def _recheck_conflicts(self) -> None:
        """A served name may have been freed: converge the keys refused with
        ``ModelNameConflict`` again."""
        if self._conflicts:
            for key in self._conflicts:
                self._done.pop(key, None)
            self._conflicts.clear()
            self._signal()

    def _report_key(self, key: str) -> str:
        parsed = self._keys.parse_assignment(key)
        assert parsed is not None
        return self._keys.report(*parsed)

    async def _report(self, key: str, state: AssignmentState, *, namespace: str, name: str,
                      generation: int, revision: str = "", reason: str = "", message: str = "",
                      endpoint: str = "", resident_bytes: int = 0,
                      freed_bytes: int = 0, estimated_bytes: int = 0) -> None:
        # shielded: a key's task cancelled meanwhile never cuts another report's write short
        await asyncio.shield(self._reg.put_report(self._report_key(key), AssignmentReport(
            node=self.node_name, namespace=namespace, name=name, generation=generation,
            revision=revision, state=state, reason=reason, message=message, endpoint=endpoint,
            resident_bytes=resident_bytes, freed_bytes=freed_bytes,
            estimated_bytes=estimated_bytes)))

    def _lock(self, key: str) -> asyncio.Lock:
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = asyncio.Lock()
        return lock

    async def _converge_one(self, key: str, d: Assignment | _Invalid) -> bool:
        """Bring one assignment to ``d`` (under its key's lock): False when that was called
        off (the assignment changed meanwhile, an unload called the load off), True when it
        is done — loaded, in standby, or failed with its report written."""
        self._reported.add(key)
        self._conflicts.discard(key)
        if isinstance(d, _Invalid):
            self._failed.pop(key, None)
            await self._report(key, AssignmentState.FAILED, namespace=d.namespace,
                               name=d.name, generation=d.generation,
                               reason="InvalidAssignment", message=d.message)
            return True
        spec = _Spec.of(d)
        loaded = self._loaded.get(key)
        if loaded is not None and loaded.spec.model_id != spec.model_id:
            del self._loaded[key]  # now served under another name: the old one goes
            self._let_go(key, loaded, "changed")
            loaded = None
        if loaded is not None and loaded.spec == spec:
            # no-op unless e.g. the generation moved
            if loaded.standby:
                await self._standby(key, d, loaded)
            else:
                await self._ready(key, d, loaded)
            return True
        failed = self._failed.get(key)
        if failed is not None and failed.spec != spec:
            failed = None  # a new spec: load it at once, attempts start over
        if failed is not None and (failed.retry_at is None
                                   or time.monotonic() < failed.retry_at):
            # waiting to retry (or not retried); the report follows the generation
            await self._report(key, AssignmentState.FAILED, namespace=d.namespace,
                               name=d.name, generation=d.generation, revision=spec.revision,
                               reason=failed.reason, message=failed.message,
                               estimated_bytes=failed.estimated_bytes)
            return True
        # the name is taken by another deployment's revision, loaded or being loaded
        owner = next((k for k, m in [*((k, v.spec.model_id) for k, v in self._loaded.items()),
                                     *self._claims.items()]
                      if m == spec.model_id and k != key
                      and self._keys.parse_assignment(k)[1:3] != (d.namespace, d.name)),
                     None)
        if owner is not None:
            self._failed.pop(key, None)
            self._conflicts.add(key)  # converged again once a served name is freed
            await self._report(key, AssignmentState.FAILED, namespace=d.namespace,
                               name=d.name, generation=d.generation,
                               revision=spec.revision, reason="ModelNameConflict",
                               message=f"model name {spec.model_id!r} is already served "
                                       f"for assignment {owner}")
            return True
        if d.lifecycle.prefetch == PREFETCH_ON_DEMAND and failed is None and (
                loaded is None or loaded.standby):
            # OnDemand: nothing is fetched or loaded before the first request (ensure_loaded)
            self._loaded[key] = waiting = _Loaded(spec, 0, last_used=self._clock(),
                                                  standby=True, standby_reason=AWAITING_REQUEST)
            log.info("%s revision %s (assignment %s) is OnDemand: standby until the first "
                     "request", spec.model_id, spec.revision, key)
            await self._standby(key, d, waiting)
            return True
        self._claims[key] = spec.model_id  # no await since the owner check: no race for it
        tried = self._attempted.get(key)
        self._attempted[key] = spec
        if tried is not None and (tried.model_id, tried.revision) not in {
                (spec.model_id, spec.revision), *self._draining}:
            self._forget(tried)  # an earlier attempt under another name left its series
        try:
            return await self._load(key, d, spec, retry=failed)
        finally:
            del self._claims[key]
            if key not in self._loaded:
                self._recheck_conflicts()

    def _forget(self, spec: _Spec) -> None:
        """``spec``'s revision is no longer assigned here: drop its usage history and every
        metric series labelled with it (none is left behind), unless it is assigned again."""
        ident = (spec.model_id, spec.revision)
        if any((v.spec.model_id, v.spec.revision) == ident for v in self._loaded.values()):
            return
        self.history.forget(ident)
        self._metrics.remove_revision(*ident)

    def _drain(self, spec: _Spec) -> None:
        """Unload ``spec``'s revision after its running requests finish (in the background, so a
        long drain never holds up other assignments). A revision assigned again meanwhile is
        loaded anew once the drain is over (see :meth:`_load`)."""
        ident = (spec.model_id, spec.revision)

        async def run() -> None:
            try:
                t0 = time.perf_counter()
                await self._core.unload_model(spec.model_id, spec.revision,
                                              drain_seconds=DRAIN_SECONDS)
                self._metrics.model_unload_seconds.labels(UNLOAD_UNASSIGNED).observe(
                    time.perf_counter() - t0)
                self._metrics.model_unloads.labels(UNLOAD_UNASSIGNED).inc()
            except Exception:  # noqa: BLE001 - logged; the core stays usable
                log.exception("unloading %s revision %s failed", *ident)
            finally:
                self._forget(spec)  # after the core's last write to its series
                if self._draining.get(ident) is task:
                    del self._draining[ident]
                    self._signal()

        task = asyncio.create_task(run(), name=f"drain {spec.model_id}@{spec.revision}")
        self._draining[ident] = task

    async def _ready(self, key: str, a: Assignment, loaded: _Loaded) -> None:
        await self._report(key, AssignmentState.READY, namespace=a.namespace, name=a.name,
                           generation=a.generation, revision=loaded.spec.revision,
                           reason="ModelLoaded", endpoint=self.advertise_url,
                           message=f"serving {loaded.spec.model_id} from {loaded.spec.uri}",
                           resident_bytes=loaded.resident_bytes,
                           estimated_bytes=loaded.estimated_bytes)

    @staticmethod
    def _standby_reason(loaded: _Loaded) -> str:
        if loaded.unload is not None:
            return loaded.unload.reason
        return loaded.standby_reason or IDLE_UNLOADED

    async def _standby(self, key: str, a: Assignment, loaded: _Loaded) -> None:
        """Report a standby revision: ``Unloaded`` with reason ``IdleUnloaded``, ``Evicted`` or
        ``AwaitingRequest`` (:func:`~mlx_fleet.contract.is_standby`), still at its endpoint (a
        request loads it), nothing resident, the bytes its unload freed."""
        unload = loaded.unload
        reason = self._standby_reason(loaded)
        if unload is not None:
            message = unload.message()
        elif reason == AWAITING_REQUEST:
            message = (f"lifecycle.prefetch is OnDemand: {loaded.spec.model_id} is fetched and "
                       f"loaded from {loaded.spec.uri} at the first request")
        else:
            message = "unloaded while idle; the next request reloads it"
        await self._report(key, AssignmentState.UNLOADED, namespace=a.namespace, name=a.name,
                           generation=a.generation, revision=loaded.spec.revision,
                           reason=reason, endpoint=self.advertise_url, message=message,
                           resident_bytes=0,
                           freed_bytes=unload.freed_bytes if unload is not None else 0,
                           estimated_bytes=loaded.estimated_bytes)

    # -- idle unload, eviction, predictive prefetch and reload on demand --------------------
    async def _lifecycle(self) -> None:
        """Every ``lifecycle_interval`` seconds, one :meth:`tick`."""
        while True:
            await asyncio.sleep(self._lifecycle_interval)
            await self.tick()
            self.lifecycle_passes += 1

    async def tick(self) -> list[asyncio.Task]:
        """One lifecycle pass: :meth:`unload_idle`, then :meth:`prefetch`, then the memory and
        idle-time gauges (:meth:`observe`, in the background: measuring MLX memory waits for
        the MLX thread, which must never hold up the pass). Returns the prefetch reloads
        started (tasks; await them to wait until the revisions are resident)."""
        await self.unload_idle()
        started = self.prefetch()
        if self._observing is None or self._observing.done():
            self._observing = asyncio.create_task(self.observe(), name="controller:observe")
        return started

    async def unload_idle(self) -> list[tuple[str, str]]:
        """Unload every loaded revision that has had no request for its assignment's
        ``idle_unload_seconds`` (0 = never), has none in flight, is not pinned
        (``lifecycle.pinned``, the deployment's ``minReady``) and is not being loaded or
        reloaded. Returns the ``(model id, revision)`` unloaded."""
        now = self._clock()
        done: list[tuple[str, str]] = []
        for key in idle_unloads(self._uses(now).values(), now):
            unload = await self._to_standby(key, IDLE_UNLOADED)  # type: ignore[arg-type]
            if unload is not None:
                done.append((unload.model_id, unload.revision))
        return done

    def _uses(self, now: float) -> dict[str, ModelUse]:
        """Assignment key → the lifecycle facts of each resident revision that is currently
        assigned as loaded and not busy (a revision with requests in flight counts as used
        now). ``resident_bytes``: its reservation (:meth:`_in_use`)."""
        _, held = self._in_use()
        uses: dict[str, ModelUse] = {}
        for key, loaded in self._loaded.items():
            d = self._desired.get(key)
            if (loaded.standby or key not in held or not isinstance(d, Assignment)
                    or _Spec.of(d) != loaded.spec or self._lock(key).locked()):
                continue
            in_flight = self._core.inflight_requests(loaded.spec.model_id, loaded.spec.revision)
            if in_flight:
                loaded.last_used = now  # so idleness counts from its last request's end
            uses[key] = ModelUse(key, loaded.last_used, in_flight,
                                 d.lifecycle.idle_unload_seconds, pinned=d.lifecycle.pinned,
                                 resident_bytes=held[key])
        return uses

    def _in_use(self, exclude: str | None = None) -> tuple[int, dict[str, int]]:
        """Memory the node's resident revisions hold, as the serving core accounts it:
        ``(total bytes, {assignment key: bytes})``. A revision this controller loaded holds
        ``max(its estimate, ServingCore.memory_bytes)`` — the estimate reserves its KV cache at
        the assignment's limits, the core's figure is its parameters plus its prompt cache now;
        any other revision in the core (one draining) its ``memory_bytes``; a revision the core
        is loading now its estimate. ``exclude``: an assignment key left out (the one about to
        be (re)loaded)."""
        held: dict[str, int] = {}
        tracked: set[tuple[str, str]] = set()
        for key, loaded in self._loaded.items():
            ident = (loaded.spec.model_id, loaded.spec.revision)
            if loaded.standby or not self._core.is_loaded(*ident):
                continue
            tracked.add(ident)
            if key != exclude:
                held[key] = max(loaded.estimated_bytes, self._core.memory_bytes(*ident))
        other = sum(self._core.memory_bytes(m.model_id, m.revision) for m in self._core.models()
                    if (m.model_id, m.revision) not in tracked)
        other += sum(b for k, b in self._loading.items() if k != exclude and k not in held)
        return sum(held.values()) + other, held

    def _resident_count(self, spec: _Spec) -> int:
        """Revisions resident in the core now (draining ones included) or being loaded by this
        controller, ``spec``'s own revision left out (the one about to be (re)loaded)."""
        own = (spec.model_id, spec.revision)
        idents = {(m.model_id, m.revision) for m in self._core.models()}
        idents.update(self._loading_ids.values())
        idents.discard(own)
        return len(idents)

    async def _make_room(self, key: str, spec: _Spec, need: int, *, evict: bool) -> None:
        """Before loading ``spec`` (estimate ``need`` bytes) for ``key``: when it does not fit
        what :meth:`_in_use` leaves of :attr:`budget_bytes`, or one more resident revision
        (:meth:`_resident_count` + 1) would exceed :attr:`max_loaded_models`, evict idle,
        unpinned revisions with nothing in flight, least recently used first
        (:func:`~.lifecycle.evictions`, both constraints at once), to standby
        (``Unloaded``/``Evicted``; a request reloads them). Raises :class:`ModelLoadError` with
        the numbers when even that is not enough, or when it does not fit and ``evict`` is
        False (a prefetch never evicts): :data:`INSUFFICIENT_MEMORY` when memory is what
        fails, else :data:`MODEL_LIMIT`. No budget and no limit: nothing to check."""
        budget, limit = self.budget_bytes, self.max_loaded_models
        if budget is None and not limit:
            return

        def state() -> tuple[int, dict[str, int], int, int, int]:
            """(used, held, free, needed, count); without a budget memory always fits."""
            used, held = self._in_use(exclude=key)
            if budget is None:
                return used, held, 0, 0, self._resident_count(spec)
            return used, held, budget - used, need, self._resident_count(spec)

        used, held, free, needed, count = state()
        if needed <= free and (not limit or count < limit):
            return
        victims: list | None = None
        uses: list[ModelUse] = []
        if evict:
            now = self._clock()
            uses = [u for k, u in self._uses(now).items() if k != key]
            victims = evictions(uses, needed, free, now, max_loaded_models=limit,
                                resident=count)
        if victims:
            if needed > free:
                why = (f"needs {format_bytes(need)}; {format_bytes(max(free, 0))} free of the "
                       f"node's budget {format_bytes(budget)}")
            else:
                why = (f"{count} of the node's limit of {limit} loaded models "
                       "(--max-loaded-models) are resident")
            cause = f"{spec.model_id} revision {spec.revision} ({why})"
            for victim in victims:
                # shielded: the load being called off must not leave a victim half unloaded
                await asyncio.shield(self._to_standby(victim, EVICTED,  # type: ignore[arg-type]
                                                      cause=cause))
            used, held, free, needed, count = state()
            if needed <= free and (not limit or count < limit):
                return
        blockers = ("cannot be evicted (pinned by minReady, serving requests or busy)" if evict
                    else "a prefetch does not evict")
        # which constraint fails: memory, unless evicting would have satisfied it alone
        memory_fails = needed > free and (
            victims is not None or evictions(uses, needed, free, self._clock()) is None)
        if memory_fails:
            raise ModelLoadError(INSUFFICIENT_MEMORY, (
                f"{spec.model_id} revision {spec.revision} needs {format_bytes(need)} ({need} "
                f"bytes) but only {format_bytes(max(free, 0))} of the node's budget "
                f"{format_bytes(budget)} is free: {format_bytes(used)} is held by {len(held)} "
                f"resident revision(s) that {blockers}"))
        raise ModelLoadError(MODEL_LIMIT, (
            f"{spec.model_id} revision {spec.revision} would be loaded model {count + 1} but "
            f"the node's limit is {limit} (--max-loaded-models): {count} revision(s) are "
            f"resident or loading that {blockers}"))

    async def _to_standby(self, key: str, reason: str, *, cause: str = "") -> IdleUnload | None:
        """Unload ``key``'s revision to standby — ``reason`` :data:`IDLE_UNLOADED` (it must
        still be idle for its policy) or :data:`EVICTED` (``cause``: the load it makes room
        for) — measuring memory before and after, and report it ``Unloaded`` with that reason
        and the freed bytes. None when it no longer qualifies (used meanwhile, pinned,
        reassigned, busy)."""
        lock = self._lock(key)
        if lock.locked():
            return None
        async with lock:
            loaded = self._loaded.get(key)
            if loaded is None or loaded.standby:
                return None
            spec = loaded.spec
            before: MemoryUsage | None = None
            try:
                before = await self._core.memory_usage()
            except Exception as e:  # noqa: BLE001 - a measurement: unload anyway
                log.warning("cannot measure memory before unloading %s revision %s: %s",
                            spec.model_id, spec.revision, e)
            # checked again after the await, and nothing awaits from here to the unload: no
            # request can be admitted in between (it would see the revision in standby and
            # wait for this lock to reload it)
            d = self._desired.get(key)
            now = self._clock()
            if (self._loaded.get(key) is not loaded or not isinstance(d, Assignment)
                    or _Spec.of(d) != spec or d.lifecycle.pinned
                    or self._core.inflight_requests(spec.model_id, spec.revision)):
                return None
            if reason == IDLE_UNLOADED and (
                    d.lifecycle.idle_unload_seconds <= 0
                    or now - loaded.last_used < d.lifecycle.idle_unload_seconds):
                return None
            loaded.standby = True
            try:
                t0 = time.perf_counter()
                # nothing is in flight: the drain ends at once; it is only a safety net
                await self._core.unload_model(spec.model_id, spec.revision,
                                              drain_seconds=DRAIN_SECONDS)
                self._metrics.model_unload_seconds.labels(reason).observe(
                    time.perf_counter() - t0)
            except Exception:  # noqa: BLE001 - logged; the core stays usable
                log.exception("unloading %s revision %s (%s) failed", spec.model_id,
                              spec.revision, reason)
            after: MemoryUsage | None = None
            try:
                after = await self._core.memory_usage()
            except Exception as e:  # noqa: BLE001
                log.warning("cannot measure memory after unloading %s revision %s: %s",
                            spec.model_id, spec.revision, e)
            freed = (max(before.mlx_bytes - after.mlx_bytes, 0)
                     if before is not None and after is not None else 0)
            unload = IdleUnload(spec.model_id, spec.revision, now - loaded.last_used,
                                d.lifecycle.idle_unload_seconds, before, after, freed,
                                reason=reason, cause=cause)
            loaded.unload = unload
            (self.evicted if reason == EVICTED else self.idle_unloaded)[
                (spec.model_id, spec.revision)] = unload
            self._metrics.model_unloads.labels(reason).inc()
            self._metrics.unload_freed_bytes.labels(reason).inc(freed)
            log.info("%s revision %s (assignment %s): %s", spec.model_id, spec.revision, key,
                     unload.message())
            await self._standby(key, d, loaded)
            return unload

    def prefetch(self) -> list[asyncio.Task]:
        """Predictive prefetch: reload the standby revisions that
        :func:`~.lifecycle.predict_prefetch` expects a request for within the prefetch window
        (their usage history is periodic), at most ``max_prefetches`` running at once, only
        those whose last estimate fits the node's free budget and that leave the node within
        ``max_loaded_models`` (a prefetch never evicts).
        Reported ``Loading``/``PredictivePrefetch`` then ``Ready``. Returns the reloads
        started (a request arriving meanwhile waits for the same reload)."""
        allowance = self._max_prefetches - len(self._prefetches)
        if allowance <= 0:
            return []
        standby: dict[tuple[str, str], str] = {}
        for key, loaded in self._loaded.items():
            ident = (loaded.spec.model_id, loaded.spec.revision)
            d = self._desired.get(key)
            if (loaded.standby and isinstance(d, Assignment) and _Spec.of(d) == loaded.spec
                    and ident not in self._reloads and not self._lock(key).locked()):
                standby[ident] = key
        if not standby:
            return []
        started: list[asyncio.Task] = []
        reserved = 0  # estimates of the prefetches started in this pass
        for ident in predict_prefetch(self.history, self._clock(), unloaded=standby,
                                      window_s=self._prefetch_window,
                                      max_prefetches=allowance):
            key = standby[ident]  # type: ignore[index]
            loaded = self._loaded[key]
            limit = self.max_loaded_models
            if limit and self._resident_count(loaded.spec) + len(started) >= limit:
                log.info("not prefetching %s revision %s: the node's limit of %d loaded models "
                         "is reached (a prefetch does not evict)", *ident, limit)
                continue
            if self.budget_bytes is not None:
                free = self.budget_bytes - self._in_use(exclude=key)[0] - reserved
                if loaded.estimated_bytes > free:
                    log.info("not prefetching %s revision %s: its estimate %s does not fit the "
                             "%s free (a prefetch does not evict)", *ident,
                             format_bytes(loaded.estimated_bytes), format_bytes(max(free, 0)))
                    continue
            reserved += loaded.estimated_bytes
            log.info("prefetching %s revision %s (assignment %s): a request is expected within "
                     "%gs", *ident, key, self._prefetch_window)
            task = self._start_reload(key, loaded.spec, PREDICTIVE_PREFETCH)
            self._prefetches.add(task)
            task.add_done_callback(self._prefetches.discard)
            self.prefetches += 1
            started.append(task)
        return started

    async def observe(self) -> None:
        """Set the memory gauges (``mlxfleet_agent_memory_bytes`` by kind: ``weights`` of the
        resident revisions from their safetensors headers, ``kv_cache`` = what the core
        accounts beyond the weights (prompt/KV caches), ``mlx_cache`` = MLX's buffer cache,
        ``free`` = budget − :meth:`_in_use`) and each assigned revision's idle seconds."""
        now = self._clock()
        weights = kv_cache = 0
        for key, loaded in self._loaded.items():
            if not isinstance(self._desired.get(key), Assignment):
                continue
            ident = (loaded.spec.model_id, loaded.spec.revision)
            self._metrics.model_idle_seconds.labels(*ident).set(max(now - loaded.last_used, 0))
            if not loaded.standby and self._core.is_loaded(*ident):
                weights += loaded.resident_bytes
                kv_cache += max(self._core.memory_bytes(*ident) - loaded.resident_bytes, 0)
        self._metrics.memory_bytes.labels("weights").set(weights)
        self._metrics.memory_bytes.labels("kv_cache").set(kv_cache)
        try:
            usage = await self._core.memory_usage()
            self._metrics.memory_bytes.labels("mlx_cache").set(usage.cache_bytes)
        except Exception as e:  # noqa: BLE001 - a measurement
            log.debug("cannot measure memory: %s", e)
        if self.budget_bytes is not None:
            self._metrics.memory_bytes.labels("free").set(
                max(self.budget_bytes - self._in_use()[0], 0))

    async def ensure_loaded(self, model_id: str, revision: str) -> None:
        """Make sure ``model_id`` revision ``revision`` is resident before a request uses it:
        a revision unloaded for idleness (standby) is reloaded — once, however many requests
        wait for it (single flight) — and this returns when it is Ready. Counts as a use.

        Raises :class:`~node_agent.serving.ModelNotLoaded` when the revision is not served
        here (or its assignment went away meanwhile), :class:`~node_agent.serving.Overloaded`
        when ``max_reload_waiters`` requests already wait for its reload (``retry_after_seconds``:
        the last load's duration, at least 1), :class:`~node_agent.serving.ModelLoadError` when
        the reload failed (the report says ``Failed``; it is retried like any failed load)."""
        ident = (model_id, revision)
        found = next(((k, v) for k, v in self._loaded.items()
                      if (v.spec.model_id, v.spec.revision) == ident), None)
        task = self._reloads.get(ident)
        if task is None:
            if found is None or not found[1].standby:
                if found is not None and self._core.is_loaded(model_id, revision):
                    found[1].last_used = self._clock()  # a use; touch() records the arrival
                    return
                raise ModelNotLoaded(model_id, revision)
        waiting = self._reload_waiters.get(ident, 0)
        if waiting >= self.max_reload_waiters:
            seconds = found[1].load_seconds if found is not None else 0.0
            raise Overloaded(f"{waiting} requests are already waiting for revision {revision} "
                             f"of {model_id} to reload (limit {self.max_reload_waiters})",
                             retry_after_seconds=max(1, math.ceil(seconds)))
        if task is None:
            assert found is not None
            self.reloads += 1
            task = self._start_reload(found[0], found[1].spec, RELOADING_ON_DEMAND)
        self._reload_waiters[ident] = waiting + 1
        try:
            await asyncio.shield(task)  # a waiter that leaves does not cancel the reload
        finally:
            n = self._reload_waiters[ident] - 1
            if n:
                self._reload_waiters[ident] = n
            else:
                del self._reload_waiters[ident]
        self._mark_used(model_id, revision)

    def _start_reload(self, key: str, spec: _Spec, reason: str) -> asyncio.Task:
        """Start the single-flight reload of ``key``'s standby revision (registered so that
        every request for it waits for this one)."""
        ident = (spec.model_id, spec.revision)
        task = asyncio.create_task(self._reload(key, spec, reason),
                                   name=f"reload {spec.model_id}@{spec.revision}")
        self._reloads[ident] = task

        def done(t: asyncio.Task) -> None:
            if self._reloads.get(ident) is t:
                del self._reloads[ident]
            if not t.cancelled():
                t.exception()  # retrieved: the waiters got it (or left)

        task.add_done_callback(done)
        return task

    async def _reload(self, key: str, spec: _Spec, reason: str = RELOADING_ON_DEMAND) -> None:
        """Load a standby revision again (under its key's lock): ``Loading`` with ``reason``
        (:data:`RELOADING_ON_DEMAND` for a waiting request, :data:`PREDICTIVE_PREFETCH`), then
        ``Ready``; raises if it did not come back."""
        async with self._lock(key):
            loaded = self._loaded.get(key)
            if (loaded is not None and not loaded.standby
                    and self._core.is_loaded(spec.model_id, spec.revision)):
                return  # loaded meanwhile
            d = self._desired.get(key)
            if loaded is None or not isinstance(d, Assignment) or _Spec.of(d) != spec:
                raise ModelNotLoaded(spec.model_id, spec.revision)  # reassigned meanwhile
            log.info("reloading %s revision %s (%s, assignment %s)", spec.model_id,
                     spec.revision, reason, key)
            await self._load(key, d, spec, on_demand=True, reason=reason)
            now = self._loaded.get(key)
            if now is not None and not now.standby and self._core.is_loaded(spec.model_id,
                                                                            spec.revision):
                return
            self._signal()  # the converge worker schedules the retry (or what replaced it)
            failure = self._failed.get(key)
            if failure is not None:
                raise ModelLoadError(failure.reason, failure.message)
            raise ModelLoadError("LoadFailed", f"revision {spec.revision} of {spec.model_id} "
                                 "could not be reloaded")

    async def _load(self, key: str, a: Assignment, spec: _Spec, *,
                    retry: _Failure | None = None, on_demand: bool = False,
                    reason: str = RELOADING_ON_DEMAND) -> bool:
        """Load ``spec`` for ``key``; ``retry``: the failure this attempt retries (the report
        then stays Failed until the load succeeds, unless a download shows progress).
        A remote source (``hf://``, ``https://``) is downloaded first: ``Prefetching`` with
        ``progress`` (written at most every :data:`_PROGRESS_REPORT_SECONDS`), then
        ``Loading``, then ``Ready``. ``on_demand``: a reload of an idle-unloaded revision for a
        waiting request: ``Loading`` at once (its files are normally local already; should
        they download again, ``Prefetching`` shows it once bytes flow); ``reason``: its
        ``Loading`` reason (:data:`RELOADING_ON_DEMAND`, :data:`PREDICTIVE_PREFETCH`).
        Before the core loads anything, :meth:`_make_room` checks the estimate against the
        node's budget and the revision count against ``max_loaded_models``, evicting idle
        revisions if needed (a prefetch never evicts). Every report carries the memory
        estimate (``estimated_bytes``) once the agent knows it — from the files' headers, or
        from the revision's last load or attempt — Failed ones included, so the operator can
        place it with its size.

        Returns True when it is done (Ready, or Failed and reported), False when it was called
        off (the assignment changed or went away during the download, an unload called the
        load off). Cancellable at any point: the download stops (its partial files stay for a
        resume), a load the core completed regardless is unloaded again."""
        common = dict(namespace=a.namespace, name=a.name, generation=a.generation,
                      revision=spec.revision)
        remote = is_remote(spec.uri)
        t0 = time.monotonic()
        known = self._known_estimate(key, spec)
        if on_demand:
            before = self._loaded.get(key)
            why = ("a request is expected soon (predictive prefetch)"
                   if reason == PREDICTIVE_PREFETCH else "on demand")
            was = (self._standby_reason(before) if before is not None else IDLE_UNLOADED)
            await self._report(key, AssignmentState.LOADING, reason=reason,
                               message=f"loading {spec.model_id} from {spec.uri} {why} "
                                       f"(standby: {was})", estimated_bytes=known, **common)
        elif retry is None:
            if remote:
                await self._report_prefetch(key, spec, DownloadProgress(), common)
            else:
                await self._report(key, AssignmentState.LOADING, reason="LoadingModel",
                                   message=f"loading {spec.model_id} from {spec.uri}",
                                   estimated_bytes=known, **common)
            log.info("%s %s revision %s from %s (assignment %s)",
                     "fetching" if remote else "loading", spec.model_id, spec.revision,
                     spec.uri, key)
        else:
            log.info("retrying load of %s revision %s from %s (assignment %s, attempt %d)",
                     spec.model_id, spec.revision, spec.uri, key, retry.attempts + 1)
        draining = self._draining.get((spec.model_id, spec.revision))
        if draining is not None:  # assigned again while it drains: let the unload finish first
            await asyncio.shield(draining)
        est: memory_estimate.MemoryEstimate | None = None

        async def fail(reason: str, message: str) -> bool:
            await self._fail(key, spec, reason, message, common,
                             estimated_bytes=est.total_bytes if est is not None else known)
            return True

        try:
            shown = False
            if remote:
                fetched = await self._prefetch(key, spec, common,
                                               shown=retry is None and not on_demand)
                if fetched is None:
                    return False  # the assignment changed or went away; its new task takes over
                path, shown = fetched
            else:
                path = await asyncio.to_thread(self._resolve, spec.uri)
            # Read and check the headers before anything is loaded: a hostile or malformed
            # safetensors header or config.json is refused here with its reason, and the
            # estimate (weights + KV cache at the assignment's limits) goes into the reports.
            est = await asyncio.to_thread(
                memory_estimate.estimate, path, max_context_tokens=spec.max_context_tokens,
                max_concurrent_sequences=spec.max_concurrent_sequences)
            if shown:
                await self._report(key, AssignmentState.LOADING, reason="LoadingModel",
                                   message=f"loading {spec.model_id} from {path}",
                                   estimated_bytes=est.total_bytes, **common)
            await self._make_room(key, spec, est.total_bytes,
                                  evict=not (on_demand and reason == PREDICTIVE_PREFETCH))
            # reserved until it is resident, so a concurrent load (another assignment's, a
            # reload on demand) counts it and cannot over-commit the budget
            self._loading[key] = est.total_bytes
            self._loading_ids[key] = (spec.model_id, spec.revision)
            try:
                await self._core.load_model(
                    spec.model_id, path, revision=spec.revision,
                    max_concurrent_sequences=spec.max_concurrent_sequences,
                    max_context_tokens=spec.max_context_tokens)
            except asyncio.CancelledError:
                # the core calls the load off, unless it completed just now: then nothing may
                # stay resident that no assignment tracks
                held = self._loaded.get(key)
                if (self._core.is_loaded(spec.model_id, spec.revision) and (
                        held is None or (held.spec.model_id, held.spec.revision)
                        != (spec.model_id, spec.revision))):
                    self._drain(spec)
                raise
            finally:
                del self._loading[key]
                del self._loading_ids[key]
            resident = est.weights_bytes
        except memory_estimate.ModelFileError as e:
            return await fail(e.reason, e.message)
        except ModelLoadError as e:
            if e.reason == LOAD_CANCELLED:  # an unload (the assignment changed or went) called
                log.info("loading %s revision %s called off: %s", spec.model_id,  # it off
                         spec.revision, e.message)
                return False                # not a failure: the key's next task takes over
            return await fail(e.reason, e.message)
        except SourceError as e:
            return await fail(e.reason, e.message)
        except ValueError as e:
            return await fail("InvalidAssignment", str(e))
        except Exception as e:  # MLX or anything else: the assignment fails, the agent lives
            log.exception("loading %s failed", spec.model_id)
            return await fail("LoadFailed", f"{type(e).__name__}: {e}")
        self._failed.pop(key, None)
        self._loaded[key] = loaded = _Loaded(spec, resident, last_used=self._clock(),
                                             load_seconds=time.monotonic() - t0,
                                             estimated_bytes=est.total_bytes)
        self._metrics.model_loads.labels(reason if on_demand else LOAD_ASSIGNED).inc()
        log.info("model %s revision %s ready (assignment %s)", spec.model_id, spec.revision, key)
        await self._ready(key, a, loaded)
        return True

    async def _report_prefetch(self, key: str, spec: _Spec, progress: DownloadProgress,
                               common: dict) -> None:
        await asyncio.shield(self._reg.put_report(self._report_key(key), AssignmentReport(
            node=self.node_name, state=AssignmentState.PREFETCHING, reason="FetchingModel",
            message=f"downloading {spec.model_id} from {spec.uri}", progress=progress,
            estimated_bytes=self._known_estimate(key, spec), **common)))

    def _known_estimate(self, key: str, spec: _Spec) -> int:
        """``spec``'s memory estimate as far as the agent knows it before reading its files
        (from its last load or failed attempt at ``key``), else 0."""
        loaded, failed = self._loaded.get(key), self._failed.get(key)
        if loaded is not None and loaded.spec == spec and loaded.estimated_bytes:
            return loaded.estimated_bytes
        return failed.estimated_bytes if failed is not None and failed.spec == spec else 0

    def _still_assigned(self, key: str, spec: _Spec) -> Assignment | None:
        """The assignment at ``key`` now, if it still asks for ``spec``."""
        d = self._desired.get(key)
        return d if isinstance(d, Assignment) and _Spec.of(d) == spec else None

    async def _prefetch(self, key: str, spec: _Spec, common: dict, *,
                        shown: bool) -> tuple[Path, bool] | None:
        """Download ``spec``'s remote source, reporting ``Prefetching`` with its progress at
        most every :data:`_PROGRESS_REPORT_SECONDS` (and once complete). ``shown``: Prefetching
        was reported already; otherwise (a retry) it is only once bytes arrive. Returns
        ``(local path, whether Prefetching was reported)``, or None when the assignment changed
        or went away meanwhile (the download is cancelled; the partial files stay for a
        resume). Raises :class:`SourceError`."""
        loop = asyncio.get_running_loop()
        latest: list[DownloadProgress] = []
        arrived = asyncio.Event()

        labels = (spec.model_id, spec.revision)
        counted = [0]  # bytes_done already added to the download counter

        def on_progress(p: DownloadProgress) -> None:
            latest[:] = [p]
            arrived.set()
            if p.bytes_done > counted[0]:
                self._metrics.download_bytes.labels(*labels).inc(p.bytes_done - counted[0])
            counted[0] = p.bytes_done
            self._metrics.download_rate.labels(*labels).set(p.rate_bytes_per_second)

        task = asyncio.ensure_future(fetch(spec.uri, self._model_cache, progress=on_progress))
        written: DownloadProgress | None = None
        last_write = -_PROGRESS_REPORT_SECONDS
        try:
            while not task.done():
                if not arrived.is_set():
                    waiter = asyncio.ensure_future(arrived.wait())
                    try:  # wakes up at least every interval to look at the assignment
                        await asyncio.wait({task, waiter}, timeout=_PROGRESS_REPORT_SECONDS,
                                           return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        waiter.cancel()
                now = self._still_assigned(key, spec)
                if now is None:
                    log.info("assignment %s changed while fetching %s; download stopped", key,
                             spec.uri)
                    return None
                common = {**common, "generation": now.generation}  # reports follow it
                if task.done() or not arrived.is_set():
                    continue
                wait = last_write + _PROGRESS_REPORT_SECONDS - loop.time()
                if wait > 0:
                    await asyncio.wait({task}, timeout=wait)
                    if task.done():
                        break
                arrived.clear()
                p = latest[0]
                if not shown and p.rate_bytes_per_second <= 0:
                    continue  # a retry stays Failed until bytes flow
                await self._report_prefetch(key, spec, p, common)
                shown, written, last_write = True, p, loop.time()
            path = task.result()
            if shown and latest and latest[0] != written:
                await self._report_prefetch(key, spec, latest[0], common)  # complete
            return path, shown
        finally:
            self._metrics.download_rate.labels(*labels).set(0)  # not downloading now
            if not task.done():
                task.cancel()
                try:
                    await task  # an https download stops between chunks
                except asyncio.CancelledError:
                    if asyncio.current_task().cancelling():  # type: ignore[union-attr]
                        raise  # we are being cancelled ourselves
                except Exception:  # noqa: BLE001 - superseded; its error no longer matters
                    pass

    async def _fail(self, key: str, spec: _Spec, reason: str, message: str, common: dict, *,
                    estimated_bytes: int = 0) -> None:
        """Report ``key``'s load of ``spec`` ``Failed`` with ``reason``/``message`` and
        ``estimated_bytes`` (0: not known), and schedule its retry (capped exponential
        back-off, :data:`RETRY_INITIAL_BACKOFF` … :data:`RETRY_MAX_BACKOFF`) unless the reason
        is permanent (:data:`PERMANENT_REASONS`)."""
        previous = self._loaded.pop(key, None)
        if previous is not None or self._core.is_loaded(spec.model_id, spec.revision):
            # what is served must be what is assigned: don't keep an older copy around
            await self._core.unload_model(spec.model_id, spec.revision)
        if previous is not None:
            self._recheck_conflicts()
        before = self._failed.get(key)
        attempts = before.attempts + 1 if before is not None and before.spec == spec else 1
        if reason in PERMANENT_REASONS:
            retry_at = None
            shown = message
        else:
            delay = min(self._retry_initial * 2 ** (attempts - 1), self._retry_max)
            retry_at = time.monotonic() + delay
            shown = f"{message} (attempt {attempts}; retrying in {delay:g}s)"
        log.error("assignment %s failed: %s: %s", key, reason, shown)
        self._failed[key] = _Failure(spec, reason, shown, attempts, retry_at, estimated_bytes)
        await self._report(key, AssignmentState.FAILED, reason=reason, message=shown,
                           estimated_bytes=estimated_bytes, **common)
