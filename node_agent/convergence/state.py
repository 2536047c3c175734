"""The agent's convergence state: one :class:`Record` per assignment key, and the constants of
the rules (:mod:`.step` decides over them; the executor modules carry the decisions out).

A record holds everything the agent knows of one assignment key — the assignment wanted now,
what the key's last task converged to, the revision loaded (or in standby) for it, its latest
failure and back-off, its last report (and so its phase), its served-name claim and conflict,
the spec its tasks last tried, the load the core is doing for it, and the key's running task
and lock — so forgetting a key is one ``del`` (:meth:`Record.forgettable` says when nothing
is left of it).

Pure: standard library, :mod:`mlx_fleet.contract` and :mod:`mlx_fleet.quantity` only. Clock
values (``last_used``, ``retry_at``) are seconds of the controller's one injected monotonic
clock; ``created_unix`` is wall-clock seconds since the epoch (shown by ``GET /v1/models``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING, Union

from mlx_fleet.contract import (EVICTED, IDLE_UNLOADED, Assignment, AssignmentReport,
                                AssignmentState, Role)
from mlx_fleet.capabilities import TASK_TEXT_GENERATION, ModelCapabilities
from mlx_fleet.quantity import format_bytes
from mlx_fleet.source_policy import SOURCE_REFUSED

if TYPE_CHECKING:  # a type only: importing node_agent.serving would load MLX
    from ..serving.types import MemoryUsage

__all__ = ["RETRY_INITIAL_BACKOFF", "RETRY_MAX_BACKOFF", "PERMANENT_REASONS",
           "PROGRESS_REPORT_SECONDS", "DRAIN_SECONDS", "LIFECYCLE_INTERVAL_SECONDS",
           "MAX_RELOAD_WAITERS", "INSUFFICIENT_MEMORY", "MODEL_LIMIT", "LOAD_ASSIGNED",
           "UNLOAD_UNASSIGNED", "ServedModel", "IdleUnload", "StandbyModel", "Spec", "Invalid",
           "Failure", "Loaded", "Record", "Desired", "Ident"]

#: Delay before the first retry of a failed load, in seconds; it doubles with every failure.
#: Short, so a replica whose disk was a moment late comes up quickly.
RETRY_INITIAL_BACKOFF = 2.0
#: Cap of the retry delay (5 minutes): a load that keeps failing (each attempt reads config and
#: maybe gigabytes of weights) must not hammer the disk or the logs, yet recovers within minutes
#: of the cause going away, without anyone touching the assignment.
RETRY_MAX_BACKOFF = 300.0
#: Failure reasons that only a change of the assignment can fix: not retried.
PERMANENT_REASONS = frozenset({"InvalidSource", "UnsupportedSource", "InvalidAssignment",
                               SOURCE_REFUSED})
#: Least interval between two Prefetching reports of one download (seconds).
PROGRESS_REPORT_SECONDS = 0.5
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

#: ``(served model name, revision)``: one revision as the serving core knows it.
Ident = tuple[str, str]


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """A served model name on this node: its deployment and the revisions it serves → role.
    ``standby``: those of them that are not resident — unloaded for idleness, evicted, or
    ``OnDemand`` and not loaded yet (a request loads them first,
    :meth:`~node_agent.controller.Controller.ensure_loaded`); the others are resident."""

    namespace: str
    name: str
    revisions: dict[str, Role]
    standby: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True)
class IdleUnload:
    """One unload of a revision to standby: ``reason`` ``IdleUnloaded`` (no request for
    ``idle_seconds`` ≥ its policy's ``idle_unload_seconds``) or ``Evicted`` (to make room for
    the load ``cause`` names, with the numbers); memory ``before`` and ``after`` it (None when
    it could not be measured), ``freed_bytes``: MLX active + cache bytes before − after
    (≥ 0)."""

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
    was last loaded or assigned (seconds since the epoch); ``capabilities``: those of its last
    load here (None: never loaded here)."""

    model_id: str
    revision: str
    max_context_tokens: int
    reason: str
    created_unix: int
    capabilities: ModelCapabilities | None = None


@dataclasses.dataclass(frozen=True)
class Spec:
    """Everything about an assignment that determines what is loaded; a change reloads."""

    model_id: str
    uri: str
    revision: str
    max_concurrent_sequences: int
    max_context_tokens: int
    task: str = TASK_TEXT_GENERATION   # Assignment.task: TextGeneration or TextEmbedding

    @classmethod
    def of(cls, a: Assignment) -> Spec:
        return cls(a.served_model_name, a.source.uri, a.source.revision,
                   a.serving.max_concurrent_sequences, a.serving.max_context_tokens, a.task)

    @property
    def ident(self) -> Ident:
        return (self.model_id, self.revision)


@dataclasses.dataclass(frozen=True)
class Invalid:
    """An assignment key whose value could not be parsed."""

    namespace: str
    name: str
    generation: int
    message: str


#: What an assignment key holds: a parsed assignment, or what could not be parsed.
Desired = Union[Assignment, Invalid]


@dataclasses.dataclass(frozen=True)
class Failure:
    """The latest failed load of an assignment's spec."""

    spec: Spec
    reason: str
    message: str           # the report's message (with attempt count and next retry)
    attempts: int
    retry_at: float | None  # clock time of the next attempt; None: not retried
    estimated_bytes: int = 0  # the revision's memory estimate, when the agent knows it


@dataclasses.dataclass
class Loaded:
    """A revision loaded (or held in standby) for an assignment.
    ``last_used``: clock time of its last request (or of its load); ``standby``: not resident
    — unloaded since (``unload`` says how) or never loaded (``OnDemand``: ``standby_reason``
    ``AwaitingRequest``) — still served on demand; ``load_seconds``: how long its last load
    took (clock seconds); ``created_unix``: wall-clock time it was loaded or assigned;
    ``digest``: the content address of a downloaded source's files ("" for a local one);
    ``capabilities``: what it serves, from its last load (None: never loaded here), reported
    with it Ready and in standby."""

    spec: Spec
    resident_bytes: int
    last_used: float = 0.0
    standby: bool = False
    estimated_bytes: int = 0  # weights + KV cache at the assignment's limits (memory_estimate)
    unload: IdleUnload | None = None
    load_seconds: float = 0.0
    standby_reason: str = ""
    created_unix: float = 0.0
    capabilities: ModelCapabilities | None = None
    digest: str = ""  # content address of the files loaded (AssignmentReport.digest)

    @property
    def reason(self) -> str:
        """The standby reason its report gives (``IdleUnloaded``, ``Evicted``,
        ``AwaitingRequest``)."""
        if self.unload is not None:
            return self.unload.reason
        return self.standby_reason or IDLE_UNLOADED


@dataclasses.dataclass(eq=False)
class Record:
    """Everything the agent holds about one assignment key.

    ``deployment``: ``(namespace, name)`` from the key. ``desired``: the assignment wanted now
    (None: not assigned here). ``done``: what the key's last finished task converged to (None:
    nothing, or it must be done again). ``loaded``: the revision loaded or in standby for it.
    ``failure``: its latest failed load (with the retry time). ``reported``: a report may exist
    (set before the first is written); ``report``: the last one written (:attr:`phase`).
    ``conflict``: refused with ``ModelNameConflict`` (converged again once a name is freed).
    ``claim``: the served name its task is loading (no other deployment may take it).
    ``attempted``: the spec its tasks last tried to load. ``loading``: ``(spec, estimate bytes)``
    while the core loads it. ``running``: what its running task works towards (its spec, an
    :class:`Invalid`, None: retiring the key); ``task``: that task (the executor's handle; the
    decisions only ask whether one runs); ``lock``: a key's task, idle unload and reload never
    interleave."""

    deployment: tuple[str, str] = ("", "")
    desired: Desired | None = None
    done: Desired | None = None
    loaded: Loaded | None = None
    failure: Failure | None = None
    reported: bool = False
    report: AssignmentReport | None = None
    conflict: bool = False
    claim: str | None = None
    attempted: Spec | None = None
    loading: tuple[Spec, int] | None = None
    running: Spec | Invalid | None = None
    task: asyncio.Task | None = None
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)

    @property
    def busy(self) -> bool:
        """A task of the key runs now."""
        return self.task is not None

    @property
    def phase(self) -> AssignmentState:
        """The state its last report gave (``Pending`` before the first)."""
        return self.report.state if self.report is not None else AssignmentState.PENDING

    @property
    def spec(self) -> Spec | None:
        """The desired assignment's spec (None: not assigned, or invalid)."""
        return Spec.of(self.desired) if isinstance(self.desired, Assignment) else None

    def assigned(self, spec: Spec) -> Assignment | None:
        """The desired assignment, if it still asks for ``spec``."""
        d = self.desired
        return d if isinstance(d, Assignment) and Spec.of(d) == spec else None

    def forgettable(self) -> bool:
        """Nothing is left of the key: not assigned, no task, nothing loaded, failed,
        reported, claimed or locked."""
        return (self.desired is None and self.done is None and self.task is None
                and self.loaded is None and self.failure is None and not self.reported
                and self.report is None
                and not self.conflict and self.claim is None and self.attempted is None
                and self.loading is None and not self.lock.locked())
