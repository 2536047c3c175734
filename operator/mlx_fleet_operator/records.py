"""The per-object records the operator keeps in memory (plain data, no I/O).

* :class:`DeploymentRecord`: everything kept per ModelDeployment (its daemon's wake-up and
  lock, the spec last synced, its assignments as last reconciled, its drain and withdrawn
  replicas, its status queue), forgotten in one place when the object is deleted
  (``Runtime.forget``);
* :class:`CandidateIntent`: what a running Canary asks of its target's placement;
  :class:`ReleasedCandidate`: one whose Canary ended, kept a grace longer;
* :class:`CanaryRecord`: per Canary (by uid), what its daemon remembers between ticks — the
  last analysis window's end and the status last patched (kopf's ``body`` lags behind it).

Held by the operator's :class:`~.runtime.Runtime`, never in module globals; lost on restart
(a restarted operator re-arms the window and reads the status back from the object).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

from mlx_fleet.contract import Assignment, StatsReport

from .analysis import WindowStats
from .rollout import DrainState
from .spec import DeploymentSpec

#: A ModelDeployment (or a Canary's target): (namespace, name).
DeploymentKey = tuple[str, str]
#: One replica of a deployment: (node, revision).
Slot = tuple[str, str]


@dataclasses.dataclass(frozen=True)
class CandidateIntent:
    """What a running Canary asks of its target ModelDeployment's placement: keep the
    candidate ``revision`` resident (``source``/``memory_bytes``: None = the target's)."""

    canary: str
    revision: str
    source: str | None = None
    memory_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class ReleasedCandidate:
    """A candidate whose Canary no longer keeps it (aborted, rolled back, failed, deleted):
    ``intent`` as it was, ``at``: ``time.monotonic()`` when its traffic split was removed."""

    intent: CandidateIntent
    at: float


@dataclasses.dataclass
class AnalysisWindow:
    """The statistics snapshot the last analysis window ended at (``at``: the tick's clock,
    seconds; ``reports``: node → the agents' cumulative statistics then), and the last stable
    window that had enough requests to judge against (``baseline``)."""

    at: float
    reports: dict[str, StatsReport]
    baseline: WindowStats | None = None


@dataclasses.dataclass
class CanaryRecord:
    """What one Canary's daemon keeps between ticks: ``window`` (None: none ended yet) and
    ``last_status``, the status it patched last (``{}``: none)."""

    window: AnalysisWindow | None = None
    last_status: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class SyncedSpec:
    """A ModelDeployment's valid ``spec`` (parsed) as last synced, with the object's
    ``metadata.generation`` and ``metadata.uid`` then."""

    spec: DeploymentSpec
    generation: int
    uid: str


@dataclasses.dataclass
class StatusQueue:
    """One ModelDeployment's status on its way to the API server (:mod:`.status_writer`):
    ``last``, the status computed last, queued or patched (``previous`` of the next
    computation; None: none yet); ``pending``, the one computed and not patched yet (None:
    nothing to patch); ``writer``, the task that patches it; ``lock``, held by each patch so
    patches stay in order."""

    last: dict[str, Any] | None = None
    pending: dict[str, Any] | None = None
    writer: asyncio.Task[None] | None = None
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)


@dataclasses.dataclass
class DeploymentRecord:
    """Everything the operator keeps about one ModelDeployment (module docstring).

    ``wake``: set to make its daemon re-sync; ``lock``: held by each sync and by the delete;
    ``synced``: the valid spec last synced (None: none yet); ``placed``: its (node, revision)
    assignments as last reconciled; ``unsettled``: whether that reconcile left something open
    (placement's ``affected_by_node``: a node change then wakes it); ``drain``: its replicas on
    draining nodes then; ``withdrawn``: slot → ``time.monotonic()`` when the status leaving it
    out of ``endpoints`` was published; ``status``: its status queue; ``released_candidate``:
    the candidate a Canary let go last (:meth:`resident_candidate`)."""

    wake: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    synced: SyncedSpec | None = None
    placed: dict[Slot, Assignment] = dataclasses.field(default_factory=dict)
    unsettled: bool = False
    drain: DrainState = DrainState()
    withdrawn: dict[Slot, float] = dataclasses.field(default_factory=dict)
    status: StatusQueue = dataclasses.field(default_factory=StatusQueue)
    released_candidate: ReleasedCandidate | None = None

    def observe_spec(self, synced: SyncedSpec) -> None:
        """A sync parsed a valid spec."""
        self.synced = synced

    def reconciled(self, placed: Mapping[Slot, Assignment], *, unsettled: bool,
                   drain: DrainState) -> bool:
        """Record a reconcile's outcome; returns whether the drain state changed."""
        changed = drain != self.drain
        self.placed = dict(placed)
        self.unsettled = unsettled
        self.drain = drain
        return changed

    def released(self, now: float, grace: float) -> set[Slot]:
        """The withdrawn slots whose withdrawal was published at least ``grace`` seconds
        before ``now`` (both ``time.monotonic()`` seconds): their assignments may go."""
        return {slot for slot, at in self.withdrawn.items() if now - at >= grace}

    def resident_candidate(self, active: CandidateIntent | None, now: float,
                           grace: float) -> CandidateIntent | None:
        """The candidate placement keeps on this deployment at ``now`` (``time.monotonic()``
        seconds): the running Canary's (``active``), else the one released less than ``grace``
        seconds ago. A Canary's traffic split is removed before its candidate is released, so
        the agents stop routing to the candidate (and forwarding to it) before it unloads —
        Argo Rollouts' ``abortScaleDownDelaySeconds``, and the endpoint grace of a drained
        replica (:meth:`released`)."""
        if active is not None:
            return active
        return self.released_candidate.intent if self.candidate_unloads_in(now, grace) else None

    def candidate_unloads_in(self, now: float, grace: float) -> float | None:
        """Seconds from ``now`` until the released candidate's grace ends (None: none released,
        or its grace is over)."""
        gone = self.released_candidate
        left = None if gone is None else gone.at + grace - now
        return left if left is not None and left > 0 else None

    def withdraw(self, slots: Collection[Slot], now: float) -> float | None:
        """The slots now withdrawn from ``endpoints`` with a published status (kept: the time
        each was first published; new ones: ``now``); returns the earliest publish time (None:
        nothing withdrawn)."""
        self.withdrawn = {slot: self.withdrawn.get(slot, now) for slot in slots}
        return min(self.withdrawn.values(), default=None)
