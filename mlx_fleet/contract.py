"""The etcd contract between the operator and the node agents: key layout and record types.

Both sides import this module; it imports only the standard library and pydantic.

Key layout (all under :data:`ROOT`, default ``/mlx-fleet/v1``; values are UTF-8 JSON)::

    <root>/nodes/<node>                                   NodeRecord        agent, bound to its lease
    <root>/assignments/<node>/<namespace>/<deployment>    Assignment        operator only
    <root>/reports/<node>/<namespace>/<deployment>        AssignmentReport  agent, bound to its lease
    <root>/placement-epoch                                PlacementEpoch    operator only

Invariants (see docs/etcd-contract.md):

* only the operator writes ``assignments/`` and ``placement-epoch``; an agent writes only its own
  ``nodes/<node>`` and ``reports/<node>/...`` keys;
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
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

ROOT = "/mlx-fleet/v1"

#: The first Apple-Silicon generation mlx-fleet supports (seed 004: M3 or later).
MIN_CHIP_GENERATION = 3


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
    def placement_epoch(self) -> str:
        return f"{self.root}/placement-epoch"

    def node_assignments_prefix(self, node: str) -> str:
        return f"{self.assignments_prefix}{_check_segment(node, 'node name')}/"

    def node_reports_prefix(self, node: str) -> str:
        return f"{self.reports_prefix}{_check_segment(node, 'node name')}/"

    # -- keys ----------------------------------------------------------------------------------
    def node(self, node: str) -> str:
        return f"{self.nodes_prefix}{_check_segment(node, 'node name')}"

    def assignment(self, node: str, namespace: str, name: str) -> str:
        return (f"{self.node_assignments_prefix(node)}{_check_segment(namespace, 'namespace')}/"
                f"{_check_segment(name, 'deployment name')}")

    def report(self, node: str, namespace: str, name: str) -> str:
        return (f"{self.node_reports_prefix(node)}{_check_segment(namespace, 'namespace')}/"
                f"{_check_segment(name, 'deployment name')}")

    # -- parsing -------------------------------------------------------------------------------
    def parse_node(self, key: str) -> str | None:
        """``<root>/nodes/<node>`` → node name, or None if the key is not a node key."""
        rest = _strip(key, self.nodes_prefix)
        return rest if rest and "/" not in rest else None

    def parse_assignment(self, key: str) -> tuple[str, str, str] | None:
        """Assignment key → ``(node, namespace, name)``, or None."""
        return _three(_strip(key, self.assignments_prefix))

    def parse_report(self, key: str) -> tuple[str, str, str] | None:
        """Report key → ``(node, namespace, name)``, or None."""
        return _three(_strip(key, self.reports_prefix))


def _strip(key: str, prefix: str) -> str | None:
    return key[len(prefix):] if key.startswith(prefix) else None


def _three(rest: str | None) -> tuple[str, str, str] | None:
    if rest is None:
        return None
    parts = rest.split("/")
    if len(parts) != 3 or not all(parts):
        return None
    return parts[0], parts[1], parts[2]


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
    """

    memory_total_bytes: Annotated[int, Field(ge=0)]
    memory_available_bytes: Annotated[int, Field(ge=0)]
    wired_limit_bytes: Annotated[int, Field(ge=0)] = 0
    chip: str
    chip_generation: Annotated[int, Field(ge=0)]
    simulated: bool = False


class NodeRecord(_Record):
    """``<root>/nodes/<node>``, written by the node's agent under its lease.

    ``address``: base URL of the agent's OpenAI-compatible API (``http://host:port``).
    ``heartbeat_unix``: seconds since the epoch of the last report (wall clock, informational;
    liveness is the lease, not this timestamp).
    """

    name: str
    address: str
    labels: dict[str, str] = Field(default_factory=dict)
    capacity: NodeCapacity
    health: NodeHealth = NodeHealth.HEALTHY
    agent_version: str = ""
    heartbeat_unix: float = Field(default_factory=time.time)


# ---------------------------------------------------------------------------------------------
# Assignments (operator → agent)
# ---------------------------------------------------------------------------------------------


class ModelSource(_Record):
    """Where the weights come from. ``uri``: ``file:///abs/path`` or an absolute path
    (``hf://`` and ``https://`` arrive with the lifecycle work). ``revision``: the user's label
    for this version of the model (a git revision for hub sources)."""

    uri: str
    revision: str


class ServingParams(_Record):
    """Per-model serving limits. Defaults follow mlx-lm's server (batch 8 sequences)."""

    max_concurrent_sequences: Annotated[int, Field(ge=1)] = 8
    max_context_tokens: Annotated[int, Field(ge=1)] = 4096


class LifecyclePolicy(_Record):
    """``idle_unload_seconds``: unload after this long without requests (0 = never; seed 001
    default 300 s). ``prefetch``: ``Eager`` fetches weights as soon as assigned; ``OnDemand``
    waits for the first request."""

    idle_unload_seconds: Annotated[int, Field(ge=0)] = 300
    prefetch: str = "Eager"


class Assignment(_Record):
    """``<root>/assignments/<node>/<namespace>/<name>``: the operator's instruction to one node
    to serve one ModelDeployment. ``generation`` is the ModelDeployment's
    ``metadata.generation`` the assignment was computed from; ``uid`` its ``metadata.uid``.
    ``served_model_name`` is the OpenAI ``model`` id clients send."""

    namespace: str
    name: str
    uid: str = ""
    generation: int = 0
    served_model_name: str
    source: ModelSource
    memory_bytes: Annotated[int, Field(ge=0)]
    serving: ServingParams = Field(default_factory=ServingParams)
    lifecycle: LifecyclePolicy = Field(default_factory=LifecyclePolicy)


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


class AssignmentReport(_Record):
    """``<root>/reports/<node>/<namespace>/<name>``: the agent's state for one assignment.

    ``generation``: the assignment generation this state refers to (stale reports are ignored
    by the operator). ``reason``: CamelCase machine reason (``ModelLoaded``, ``LoadFailed`` ...);
    ``message``: human text, e.g. the load error. ``endpoint``: URL clients use for this model.
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
    updated_unix: float = Field(default_factory=time.time)
