"""The etcd contract between the operator and the node agents: key layout and record types.

Both sides import this module; it imports only the standard library and pydantic.

Key layout (all under :data:`ROOT`, default ``/mlx-fleet/v2``; values are UTF-8 JSON)::

    <root>/nodes/<node>                                              NodeRecord     agent, lease
    <root>/assignments/<node>/<namespace>/<deployment>/<revision>    Assignment     operator only
    <root>/reports/<node>/<namespace>/<deployment>/<revision>        AssignmentReport agent, lease
    <root>/traffic/<namespace>/<deployment>                          TrafficSplit   operator only
    <root>/stats/<node>/<namespace>/<deployment>                     StatsReport    agent, lease
    <root>/placement-epoch                                           PlacementEpoch operator only

A served model is identified by **(deployment, revision)** everywhere: two revisions of one
ModelDeployment (a rolling update's surge, a canary's stable and candidate) are two assignments
on a node, two reports, two entries in the agent's model registry, and both count against the
node's memory. Contract v2 (this layout) replaced v1, whose keys had no revision segment.

Invariants (see docs/etcd-contract.md):

* only the operator writes ``assignments/``, ``traffic/`` and ``placement-epoch``; an agent
  writes only its own ``nodes/<node>``, ``reports/<node>/...`` and ``stats/<node>/...`` keys;
* node records and reports are attached to the agent's lease, so a dead Mac's keys disappear
  after the lease TTL without anyone deleting them;
* every operator write of assignments is one transaction that compares the ``mod_revision`` of
  ``placement-epoch`` and of every assignment key it read (fencing): a stale operator replica
  or a concurrent reconcile fails the compare and re-reads instead of clobbering newer state;
* watchers resume from ``last seen revision + 1`` and re-list when that revision was compacted.
"""

from __future__ import annotations

import enum
import time
from decimal import Decimal
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from mlx_fleet.capabilities import TASK_TEXT_GENERATION, ModelCapabilities, Task
from mlx_fleet.quantity import format_bytes

ROOT = "/mlx-fleet/v2"

#: The first Apple-Silicon generation mlx-fleet supports (seed 004: M3 or later).
MIN_CHIP_GENERATION = 3

#: The default share of a Mac's unified memory that resident models may take; the rest is left
#: to macOS, the agent and KV-cache growth. Source: seed 004's node budget, "watermark 80%".
#: Each agent may set its own (``--memory-watermark``, reported as
#: :attr:`NodeCapacity.memory_watermark`); this is the value of agents that don't, and of node
#: records written before the field existed.
WATERMARK = 0.8


def check_watermark(value: object) -> float:
    """``value`` as a memory watermark: a number in (0, 1], the share of unified memory resident
    models may take (not a bool, not NaN or infinite). Returns it as a ``float``. Raises
    ``ValueError`` saying what is wrong. The one check of the range: :func:`node_budget_bytes`,
    :class:`NodeCapacity` and the agent's ``--memory-watermark`` all use it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"watermark must be a number in (0, 1], got {value!r}")
    return float(value)


def node_budget_bytes(memory_total_bytes: int, wired_limit_bytes: int,
                      watermark: float = WATERMARK) -> int:
    """Bytes the node's resident models may take::

        min(floor(memory_total_bytes × watermark), wired_limit_bytes if wired_limit_bytes else ∞)

    ``memory_total_bytes``: unified memory (``hw.memsize``); ``wired_limit_bytes``: the GPU
    wired-memory limit (macOS ``iogpu.wired_limit_mb``, which caps what the GPU may wire; 0 =
    the OS default, no extra cap here); ``watermark``: share in (0, 1], default
    :data:`WATERMARK` (seed 004: 80 %; a node's own is :attr:`NodeCapacity.memory_watermark`,
    see :meth:`NodeCapacity.budget_bytes`). The product is exact (decimal), floored.
    Raises ``ValueError`` for negative bytes or a watermark outside (0, 1]
    (:func:`check_watermark`).
    """
    if not (isinstance(memory_total_bytes, int) and not isinstance(memory_total_bytes, bool) and memory_total_bytes >= 0):
        raise ValueError(f"memory_total_bytes must be a non-negative integer, "
                         f"got {memory_total_bytes!r}")
    if not (isinstance(wired_limit_bytes, int) and not isinstance(wired_limit_bytes, bool) and wired_limit_bytes >= 0):
        raise ValueError(f"wired_limit_bytes must be a non-negative integer, "
                         f"got {wired_limit_bytes!r}")
    check_watermark(watermark)
    budget = int(Decimal(memory_total_bytes) * Decimal(str(watermark)))
    return min(budget, wired_limit_bytes) if wired_limit_bytes else budget


def _check_segment(value: str, what: str) -> str:
    if not value or "/" in value or value in {".", ".."}:
        raise ValueError(f"invalid {what} {value!r}: must be non-empty and contain no '/'")
    return value


class Keys:
    """Builds and parses every etcd key of the contract under one root prefix.

    All methods return/accept ``str``; the etcd layer encodes to bytes.
    Raises ``ValueError`` for a name segment that is empty or contains ``/``.
    """

    def __init__(self, root: str = ROOT) -> None:
        self.root = root.rstrip("/")

    # -- prefixes ------------------------------------------------------------------------------
    @property
    def nodes_prefix(self) -> str:
        return f"{self.root}/nodes/"

    @property
    def assignments_prefix(self) -> str:
        return f"{self.root}/assignments/"

    @property
    def reports_prefix(self) -> str:
        return f"{self.root}/reports/"

    @property
    def traffic_prefix(self) -> str:
        return f"{self.root}/traffic/"

    @property
    def stats_prefix(self) -> str:
        return f"{self.root}/stats/"

    @property
    def placement_epoch(self) -> str:
        return f"{self.root}/placement-epoch"

    def node_assignments_prefix(self, node: str) -> str:
        return f"{self.assignments_prefix}{_check_segment(node, 'node name')}/"

    def node_reports_prefix(self, node: str) -> str:
        return f"{self.reports_prefix}{_check_segment(node, 'node name')}/"

    def node_stats_prefix(self, node: str) -> str:
        return f"{self.stats_prefix}{_check_segment(node, 'node name')}/"

    # -- keys ----------------------------------------------------------------------------------
    def node(self, node: str) -> str:
        return f"{self.nodes_prefix}{_check_segment(node, 'node name')}"

    def assignment(self, node: str, namespace: str, name: str, revision: str) -> str:
        return (f"{self.node_assignments_prefix(node)}{_check_segment(namespace, 'namespace')}/"
                f"{_check_segment(name, 'deployment name')}/{_check_segment(revision, 'revision')}")

    def report(self, node: str, namespace: str, name: str, revision: str) -> str:
        return (f"{self.node_reports_prefix(node)}{_check_segment(namespace, 'namespace')}/"
                f"{_check_segment(name, 'deployment name')}/{_check_segment(revision, 'revision')}")

    def traffic(self, namespace: str, name: str) -> str:
        return (f"{self.traffic_prefix}{_check_segment(namespace, 'namespace')}/"
                f"{_check_segment(name, 'deployment name')}")

    def stats(self, node: str, namespace: str, name: str) -> str:
        return (f"{self.node_stats_prefix(node)}"
                f"{_check_segment(namespace, 'namespace')}/"
                f"{_check_segment(name, 'deployment name')}")

    # -- parsing -------------------------------------------------------------------------------
    def parse_node(self, key: str) -> str | None:
        """``<root>/nodes/<node>`` → node name, or None if the key is not a node key."""
        rest = _strip(key, self.nodes_prefix)
        return rest if rest and "/" not in rest else None

    def parse_assignment(self, key: str) -> tuple[str, str, str, str] | None:
        """Assignment key → ``(node, namespace, name, revision)``, or None."""
        return _segments(_strip(key, self.assignments_prefix), 4)  # type: ignore[return-value]

    def parse_report(self, key: str) -> tuple[str, str, str, str] | None:
        """Report key → ``(node, namespace, name, revision)``, or None."""
        return _segments(_strip(key, self.reports_prefix), 4)  # type: ignore[return-value]

    def parse_traffic(self, key: str) -> tuple[str, str] | None:
        """Traffic key → ``(namespace, name)``, or None."""
        return _segments(_strip(key, self.traffic_prefix), 2)  # type: ignore[return-value]

    def parse_stats(self, key: str) -> tuple[str, str, str] | None:
        """Stats key → ``(node, namespace, name)``, or None."""
        return _segments(_strip(key, self.stats_prefix), 3)  # type: ignore[return-value]


def _strip(key: str, prefix: str) -> str | None:
    return key[len(prefix):] if key.startswith(prefix) else None


def _segments(rest: str | None, n: int) -> tuple[str, ...] | None:
    if rest is None:
        return None
    parts = rest.split("/")
    if len(parts) != n or not all(parts):
        return None
    return tuple(parts)


class _Record(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)

    def to_json(self) -> bytes:
        return self.model_dump_json(by_alias=True).encode()

    @classmethod
    def from_json(cls, raw: bytes | str):  # -> Self
        """Parse a stored value. Raises ``pydantic.ValidationError`` on a malformed record."""
        return cls.model_validate_json(raw)


# ---------------------------------------------------------------------------------------------
# Node records (agent → operator)
# ---------------------------------------------------------------------------------------------


class NodeHealth(str, enum.Enum):
    HEALTHY = "Healthy"
    DEGRADED = "Degraded"
    DRAINING = "Draining"


class NodeCapacity(_Record):
    """What a node offers. Bytes are unified-memory bytes.

    ``memory_total_bytes``: physical unified memory (``hw.memsize`` on macOS).
    ``memory_available_bytes``: free + reclaimable right now (``psutil.virtual_memory().available``).
    ``wired_limit_bytes``: the GPU wired-memory limit (``iogpu.wired_limit_mb``; 0 = OS default).
    ``chip``: marketing name, e.g. ``"Apple M3 Max"``; ``chip_generation``: 3 for M3, 4 for M4 ...
    ``simulated``: True when chip and memory come from configuration (Linux development), not
    from the hardware. The flag is shown wherever nodes are listed (``mlx-fleet status``, the
    agent's start-up warning); placement treats such a node like any other, which is what lets
    the local fleet run on Linux.
    ``max_loaded_models``: the most model revisions the node keeps resident at once (the
    agent's ``--max-loaded-models``; seed 004: "Per-worker max loaded models: 2"); 0 = no
    limit but memory. Placement assigns no further revision to a node whose assignments reach
    it (both sides of a canary count); the agent evicts idle revisions to stay within it.
    ``memory_watermark``: the share of ``memory_total_bytes`` resident models may take, in
    (0, 1] (the agent's ``--memory-watermark``; default and value of records older than the
    field: :data:`WATERMARK`, seed 004's 80 %); the node's budget is :meth:`budget_bytes`, the
    one rule placement and the agent share.
    """

    memory_total_bytes: Annotated[int, Field(ge=0)]
    memory_available_bytes: Annotated[int, Field(ge=0)]
    wired_limit_bytes: Annotated[int, Field(ge=0)] = 0
    chip: str
    chip_generation: Annotated[int, Field(ge=0)]
    simulated: bool = False
    max_loaded_models: Annotated[int, Field(ge=0)] = 0
    memory_watermark: Annotated[float, BeforeValidator(check_watermark)] = WATERMARK

    def budget_bytes(self) -> int:
        """Bytes this node's resident models may take: :func:`node_budget_bytes` of
        ``memory_total_bytes``, ``wired_limit_bytes`` and ``memory_watermark``."""
        return node_budget_bytes(self.memory_total_bytes, self.wired_limit_bytes,
                                 self.memory_watermark)


#: The label prefix a node agent may set on its own record (``--label``): placement matches
#: a node selector key under it against the agent's labels, every other key against the
#: MacNode's, which the cluster admin owns (issue 19; the operator's ``node_claims``).
AGENT_LABEL_PREFIX = "agent.mlx-fleet.io/"


class NodeRecord(_Record):
    """``<root>/nodes/<node>``, written by the node's agent under its lease.

    ``labels``: the agent's own labels; placement believes only those under
    :data:`AGENT_LABEL_PREFIX`.

    ``address``: base URL of the agent's OpenAI-compatible API (``http://host:port``).
    ``heartbeat_unix``: seconds since the epoch of the last report (wall clock, informational;
    liveness is the lease, not this timestamp).
    ``serving_options``: the agent's serving switches as ``{option: value}`` text (``prompt_cache``
    ``on``/``off``, ``prompt_cache_bytes`` bytes or ``auto``, ``admission_policy`` ``count``/``kv``,
    ``stream_buffer_chunks``, ``request_coalescing`` ``on``/``off``; the agent's
    ``node_agent.serving.options.ServingOptions.as_record``); informational, empty in records of
    agents older than the field (they still parse).
    ``tasks``: the model tasks this agent serves (:data:`mlx_fleet.capabilities.TASKS`; the
    agent's ``node_agent.serving.capabilities.served_tasks``); placement puts a deployment of
    another task than ``TextGeneration`` only on a node that lists it. A record of an agent
    older than the field reads as ``["TextGeneration"]``: it served text generation only.
    """

    name: str
    address: str
    labels: dict[str, str] = Field(default_factory=dict)
    capacity: NodeCapacity
    health: NodeHealth = NodeHealth.HEALTHY
    agent_version: str = ""
    serving_options: dict[str, str] = Field(default_factory=dict)
    tasks: list[Task] = Field(default_factory=lambda: [TASK_TEXT_GENERATION])
    heartbeat_unix: float = Field(default_factory=time.time)


# ---------------------------------------------------------------------------------------------
# Assignments (operator → agent)
# ---------------------------------------------------------------------------------------------


class ModelSource(_Record):
    """Where the weights come from. ``uri``: ``file:///abs/path``, an absolute path,
    ``hf://org/repo[@revision]`` (through huggingface_hub) or ``https://`` (a mirror with a
    ``manifest.json``; :mod:`node_agent.fetch`). ``revision``: the user's label for this version
    of the model (the deployment's identity for it; a hub revision goes in the URI)."""

    uri: str
    revision: str


class ServingParams(_Record):
    """Per-model serving limits. Defaults follow mlx-lm's server (batch 8 sequences)."""

    max_concurrent_sequences: Annotated[int, Field(ge=1)] = 8
    max_context_tokens: Annotated[int, Field(ge=1)] = 4096


#: ``LifecyclePolicy.prefetch`` values: fetch and load as soon as assigned, or at the first
#: request (the CRD's ``spec.lifecycle.prefetch`` enum).
PREFETCH_EAGER = "Eager"
PREFETCH_ON_DEMAND = "OnDemand"


class LifecyclePolicy(_Record):
    """``idle_unload_seconds``: unload after this long without requests (0 = never; seed 001
    default 300 s). ``prefetch``: ``Eager`` fetches weights as soon as assigned; ``OnDemand``
    waits for the first request. ``pinned``: this replica is one of the deployment's first
    ``spec.lifecycle.minReady`` (the operator pins them by node name); the agent never
    idle-unloads or evicts a pinned revision."""

    idle_unload_seconds: Annotated[int, Field(ge=0)] = 300
    prefetch: str = PREFETCH_EAGER
    pinned: bool = False


class Role(str, enum.Enum):
    """What a revision's assignment is for on its node.

    ``Stable``: the ModelDeployment's ``spec.model.revision``; it takes the deployment's traffic
    once Ready. ``Candidate``: a Canary's candidate revision; it takes the share of traffic the
    :class:`TrafficSplit` gives it. ``Previous``: the revision a rolling update is replacing;
    it keeps serving on a node until the Stable revision is Ready there, then the operator
    removes it (a surge: both are resident meanwhile)."""

    STABLE = "Stable"
    CANDIDATE = "Candidate"
    PREVIOUS = "Previous"


class Assignment(_Record):
    """``<root>/assignments/<node>/<namespace>/<name>/<revision>``: the operator's instruction to
    one node to serve one revision of one ModelDeployment. ``generation`` is the
    ModelDeployment's ``metadata.generation`` the assignment was computed from; ``uid`` its
    ``metadata.uid``. ``served_model_name`` is the OpenAI ``model`` id clients send (the same for
    every revision of a deployment); ``source.revision`` is the revision (also the key's last
    segment); ``role`` says which traffic it takes (:class:`Role`). ``task``: what the model is
    served for (:data:`mlx_fleet.capabilities.TASKS`, the CRD's ``spec.model.task``):
    ``TextGeneration`` (chat and completions) or ``TextEmbedding``
    (``POST /v1/embeddings``); records older than the field read as ``TextGeneration``."""

    namespace: str
    name: str
    uid: str = ""
    generation: int = 0
    served_model_name: str
    source: ModelSource
    memory_bytes: Annotated[int, Field(ge=0)]
    serving: ServingParams = Field(default_factory=ServingParams)
    lifecycle: LifecyclePolicy = Field(default_factory=LifecyclePolicy)
    role: Role = Role.STABLE
    task: Task = TASK_TEXT_GENERATION

    @property
    def revision(self) -> str:
        return self.source.revision


class PlacementEpoch(_Record):
    """``<root>/placement-epoch``: bumped by every assignment transaction, so concurrent
    placements of different deployments serialize through one compare (memory is shared)."""

    counter: int = 0
    writer: str = ""


# ---------------------------------------------------------------------------------------------
# Reports (agent → operator)
# ---------------------------------------------------------------------------------------------


class AssignmentState(str, enum.Enum):
    PENDING = "Pending"
    PREFETCHING = "Prefetching"
    LOADING = "Loading"
    READY = "Ready"
    UNLOADED = "Unloaded"
    FAILED = "Failed"


#: Report reason of a replica unloaded because it had no request for the assignment's
#: ``lifecycle.idle_unload_seconds`` (state ``Unloaded``). It is *standby*, not a failure: it
#: stays assigned and at its endpoint, and the next request reloads it.
IDLE_UNLOADED = "IdleUnloaded"
#: Report reason of a replica unloaded to make room for another load on its node (memory
#: pressure; least recently used first; state ``Unloaded``). Standby like ``IdleUnloaded``.
EVICTED = "Evicted"
#: Report reason of a replica with ``lifecycle.prefetch: OnDemand`` that has not been fetched
#: nor loaded yet (state ``Unloaded``): the first request fetches and loads it. Standby.
AWAITING_REQUEST = "AwaitingRequest"
#: Report reason while a standby replica reloads for a waiting request (state ``Loading``).
RELOADING_ON_DEMAND = "ReloadingOnDemand"
#: Report reason while a standby replica is reloaded ahead of a request the agent's usage
#: history predicts (predictive prefetch; state ``Loading``).
PREDICTIVE_PREFETCH = "PredictivePrefetch"

#: ``Unloaded`` reasons of a standby replica (assigned, not resident, reloaded on demand).
STANDBY_UNLOADED_REASONS = frozenset({IDLE_UNLOADED, EVICTED, AWAITING_REQUEST})
#: ``Loading`` reasons of a standby replica coming back.
STANDBY_LOADING_REASONS = frozenset({RELOADING_ON_DEMAND, PREDICTIVE_PREFETCH})


def is_standby(state: str, reason: str) -> bool:
    """True for a replica in standby: unloaded (``Unloaded`` with reason ``IdleUnloaded``,
    ``Evicted`` or ``AwaitingRequest``) or coming back (``Loading`` with reason
    ``ReloadingOnDemand`` or ``PredictivePrefetch``). It serves on demand, so it counts as
    serving for readiness and endpoints."""
    return ((state == AssignmentState.UNLOADED.value and reason in STANDBY_UNLOADED_REASONS)
            or (state == AssignmentState.LOADING.value and reason in STANDBY_LOADING_REASONS))


class DownloadProgress(_Record):
    """A model download under way (state ``Prefetching``). Bytes are bytes on the wire;
    ``bytes_total`` 0 while unknown. ``rate_bytes_per_second``: averaged over the last few
    seconds; ``eta_seconds``: remaining ÷ rate (None while the rate or total is unknown).
    ``files_done``/``files_total``: files verified / to fetch."""

    bytes_done: Annotated[int, Field(ge=0)] = 0
    bytes_total: Annotated[int, Field(ge=0)] = 0
    rate_bytes_per_second: Annotated[float, Field(ge=0)] = 0.0
    eta_seconds: Annotated[float, Field(ge=0)] | None = None
    files_done: Annotated[int, Field(ge=0)] = 0
    files_total: Annotated[int, Field(ge=0)] = 0

    def text(self) -> str:
        """The download in one line, for people (``mlx-fleet status``, a ModelDeployment's
        ``status.downloads``): ``"12.0MiB / 48.0MiB · 3.0MiB/s · ETA 0:00:12 · 1/3 files"``
        (``?`` for an unknown total, ``ETA -`` without an estimate)."""
        eta = "-"
        if self.eta_seconds is not None:
            s = int(round(self.eta_seconds))
            eta = f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
        parts = [f"{format_bytes(self.bytes_done)} / "
                 f"{format_bytes(self.bytes_total) if self.bytes_total else '?'}",
                 f"{format_bytes(int(self.rate_bytes_per_second))}/s", f"ETA {eta}"]
        if self.files_total:
            parts.append(f"{self.files_done}/{self.files_total} files")
        return " · ".join(parts)


class AssignmentReport(_Record):
    """``<root>/reports/<node>/<namespace>/<name>/<revision>``: the agent's state for one
    assignment (one revision of one deployment on this node).

    ``generation``: the assignment generation this state refers to (stale reports are ignored
    by the operator). ``reason``: CamelCase machine reason (``ModelLoaded``, ``LoadFailed`` ...);
    ``message``: human text, e.g. the load error. ``endpoint``: URL clients use for this model.
    ``progress``: the download while ``Prefetching`` (written at a bounded rate).
    ``estimated_bytes``: the revision's resident-memory estimate from its files (weights from
    the safetensors headers + KV cache at the assignment's limits), once the files are local.
    ``freed_bytes``: memory returned by the last unload to standby (state ``Unloaded``, reason
    ``IdleUnloaded`` or ``Evicted``): MLX active + cache memory measured before the unload minus
    after it (0 when it did not fall); the ``message`` gives both measurements and the process
    RSS before and after (an eviction's also names the load it made room for). A standby
    replica stays assigned: a request reloads it (:func:`is_standby`).
    ``digest``: the content address of the files this replica loaded (set from ``Loading``
    after a download, on ``Ready`` and standby reports): ``sha256:<64 hex>`` for an
    ``https://`` mirror (sha256 over its sorted ``(path, sha256)`` list), ``hf-commit:<40
    hex>`` for an ``hf://`` source (the commit downloaded), ``""`` for a local directory or
    when not known yet. Replicas of one revision reporting different digests hold different
    bytes (the operator's ``ReplicasConsistent`` condition). Records written before it parse
    with ``""``.
    ``capabilities``: what the revision serves (tools, structured outputs, logprobs, ``n``,
    embeddings, context; :class:`mlx_fleet.capabilities.ModelCapabilities`), computed from the
    loaded model; on Ready reports and on standby reports of a revision loaded here before.
    None when unknown: not loaded yet, or an agent older than the field (the fleet router then
    still sends it requests, and that agent refuses what it cannot serve).
    """

    node: str
    namespace: str
    name: str
    generation: int = 0
    revision: str = ""
    state: AssignmentState
    reason: str = ""
    message: str = ""
    endpoint: str = ""
    resident_bytes: Annotated[int, Field(ge=0)] = 0
    progress: DownloadProgress | None = None
    estimated_bytes: Annotated[int, Field(ge=0)] = 0
    freed_bytes: Annotated[int, Field(ge=0)] = 0
    capabilities: ModelCapabilities | None = None
    digest: Annotated[str, Field(max_length=128)] = ""
    updated_unix: float = Field(default_factory=time.time)


# ---------------------------------------------------------------------------------------------
# Traffic split (operator → agents) and per-revision statistics (agents → operator)
# ---------------------------------------------------------------------------------------------

#: Buckets of the per-revision split (issue #5): a session key hashes into ``SPLIT_BUCKETS``
#: buckets; bucket < weight × 100 goes to the candidate (weight in percent, 0–100).
SPLIT_BUCKETS = 10_000


class LocalGuard(_Record):
    """The agent's own fast rollback of a candidate (no operator round trip).

    Within the last ``window_seconds``, when the candidate has at least ``min_failures``
    failed requests (errors + serving-core crashes) and they are at least
    ``failure_ratio`` of its requests, the agent sends all of the deployment's traffic to the
    stable revision and reports ``guard_tripped`` at once. ``enabled: False`` turns it off."""

    enabled: bool = True
    window_seconds: Annotated[float, Field(gt=0)] = 5.0
    min_failures: Annotated[int, Field(ge=1)] = 3
    failure_ratio: Annotated[float, Field(gt=0, le=1)] = 0.5


class TrafficSplit(_Record):
    """``<root>/traffic/<namespace>/<deployment>``: how a deployment's requests are split while a
    Canary runs (absent otherwise: then each node serves its Stable revision, or a Previous one
    until the Stable one is Ready there).

    ``weight``: percent (0–100) of session buckets sent to ``candidate_revision``.
    ``canary``/``canary_uid``/``generation``: the Canary (name, uid, metadata.generation) that
    owns the split. ``stats_interval_seconds``: how often agents write their per-revision
    :class:`StatsReport` for this deployment (the analysis interval). ``candidate_endpoints``:
    agent URLs that serve the candidate, for nodes that don't hold it themselves (they forward
    the candidate share). ``guard``: the local guard's thresholds."""

    namespace: str
    name: str
    served_model_name: str
    stable_revision: str
    candidate_revision: str
    weight: Annotated[int, Field(ge=0, le=100)] = 0
    canary: str = ""
    canary_uid: str = ""
    generation: int = 0
    stats_interval_seconds: Annotated[float, Field(gt=0)] = 10.0
    candidate_endpoints: list[str] = Field(default_factory=list)
    guard: LocalGuard = Field(default_factory=LocalGuard)


#: Upper bounds (seconds) of the request-latency and time-to-first-token histograms in
#: :class:`RevisionStats` (a last, unbounded bucket follows). Fixed here so that every agent's
#: histograms merge exactly in the operator.
LATENCY_BOUNDS_SECONDS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0,
    5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)
#: Upper bounds (tokens/s) of the per-sequence decode-rate histogram in :class:`RevisionStats`.
TOKENS_PER_SECOND_BOUNDS: tuple[float, ...] = (
    1, 2, 3, 5, 7.5, 10, 15, 20, 25, 30, 40, 50, 60, 75, 100, 125, 150, 200, 250, 300, 400,
    500, 750, 1000, 2000)


class Histogram(_Record):
    """Cumulative bucket counts: ``counts[i]`` observations ``<= bounds[i]`` and
    ``> bounds[i-1]``; ``counts[-1]`` those above the last bound (so ``len(counts) ==
    len(bounds) + 1``). ``total``: sum of the observed values."""

    bounds: tuple[float, ...]
    counts: list[Annotated[int, Field(ge=0)]]
    total: float = 0.0


class RevisionStats(_Record):
    """Counters of one revision on one node, cumulative since ``started_unix`` (the agent's
    start of counting; a new value means the counters were reset, e.g. an agent restart).

    ``requests``: completed or failed generation requests routed to this revision (client
    errors — 4xx, 429 — and client hang-ups are not counted); ``errors``: of those, the ones
    that failed on the server side (5xx, a stream ended by an error);
    ``crashes``: serving-core failures that hit this revision (a model's batch reset, the MLX
    thread failing). ``latency_seconds``: request end to end; ``ttft_seconds``: time to first
    token; ``tokens_per_second``: per sequence, (completion tokens − 1) ÷ decode time (the
    intervals between the first and the last token), for requests with at least two tokens. ``memory_bytes``: resident bytes of this
    revision now (weights + its share of cache), sampled at write time."""

    revision: str
    started_unix: float
    requests: Annotated[int, Field(ge=0)] = 0
    errors: Annotated[int, Field(ge=0)] = 0
    crashes: Annotated[int, Field(ge=0)] = 0
    latency_seconds: Histogram
    ttft_seconds: Histogram
    tokens_per_second: Histogram
    memory_bytes: Annotated[int, Field(ge=0)] = 0


#: Default seconds between a node's :class:`StatsReport` writes while no canary runs (the agent's
#: ``--stats-interval-seconds``): the resolution of the operator's fleet request metrics, as
#: Prometheus' usual 15 s scrape interval.
IDLE_STATS_INTERVAL_SECONDS = 15.0


class StatsReport(_Record):
    """``<root>/stats/<node>/<namespace>/<deployment>``: one node's per-revision counters for a
    deployment it serves (or forwards for, during a canary), bound to the agent's lease. Under a
    canary written at most once per the split's ``stats_interval_seconds`` (plus once at a guard
    trip); otherwise at most once per :data:`IDLE_STATS_INTERVAL_SECONDS` (the agent's
    ``--stats-interval-seconds``) and only after new
    requests. Counters restart (a new ``started_unix``) when a canary starts or ends.

    ``guard_tripped``: the local guard sent all traffic to stable (``guard_reason`` says why,
    with the numbers); it stays set until the :class:`TrafficSplit` names a new candidate or
    goes away. ``canary_uid``: the split this report belongs to ("" outside a canary)."""

    node: str
    namespace: str
    name: str
    canary_uid: str = ""
    revisions: dict[str, RevisionStats] = Field(default_factory=dict)
    guard_tripped: bool = False
    guard_reason: str = ""
    updated_unix: float = Field(default_factory=time.time)
