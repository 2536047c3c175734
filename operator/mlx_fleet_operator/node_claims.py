"""What placement believes of a node agent's record (issue 19, finding 10). Pure functions.

A node record is written by the Mac's agent, so anyone holding an agent credential can claim any
labels and any memory there and attract deployments meant for other Macs (a ``tier=secure``
label, a terabyte of memory). Like Kubernetes' NodeRestriction admission, which keeps kubelets
from setting the ``node-restriction.kubernetes.io/`` labels the cluster admin owns, placement
trusts an agent only with what it may say about itself:

* **Labels** that ``placement.nodeSelector`` matches come from the MacNode's
  ``metadata.labels`` — set by the cluster admin (``kubectl label macnode mac-1 tier=secure``),
  which an agent cannot touch — or, for keys under :data:`AGENT_LABEL_PREFIX`
  (``agent.mlx-fleet.io/rack``), from the agent (``mlx-fleet-agent --label
  agent.mlx-fleet.io/rack=a``). A MacNode label wins over the agent's for the same key. Any other
  label in the record is ignored for placement (:func:`node_label`) and named in the MacNode's
  ``ClaimsAccepted`` condition (:func:`claims_condition`).
* **Memory** counts up to what the chip the agent names can have
  (:func:`mlx_fleet.chips.max_unified_memory_bytes`, Apple's tech specs): a claim above it is
  clamped to it (:func:`trusted_memory_bytes`) and flagged the same way. The **generation** is
  the one the chip's name says when the claimed one is higher (:func:`trusted_generation`).

An agent can still lie within those bounds (say it is an M3 Ultra with 512 GB); what it can no
longer do is claim what only the cluster admin may grant, or more than any such Mac has.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from mlx_fleet.chips import chip_generation, max_unified_memory_bytes
from mlx_fleet.contract import AGENT_LABEL_PREFIX, NodeCapacity, NodeRecord
from mlx_fleet.quantity import format_bytes

from .status import condition

__all__ = ["AGENT_LABEL_PREFIX", "CLAIMS_CONDITION", "node_label", "ignored_labels",
           "trusted_memory_bytes", "trusted_generation", "Claims", "claims", "claims_condition"]

#: The MacNode condition that says whether the agent's claims are used as reported.
CLAIMS_CONDITION = "ClaimsAccepted"
#: Labels named in a condition message; the rest are counted.
_MAX_NAMED = 10

_memory_bound = functools.lru_cache(maxsize=256)(max_unified_memory_bytes)
_generation_named = functools.lru_cache(maxsize=256)(chip_generation)


def node_label(node: NodeRecord, key: str, operator_labels: Mapping[str, str]) -> str | None:
    """The value of label ``key`` placement sees on ``node``: the MacNode's
    (``operator_labels``, its ``metadata.labels``) when it has the key, else the agent's own
    when ``key`` is under :data:`AGENT_LABEL_PREFIX`, else None (absent)."""
    if key in operator_labels:
        return operator_labels[key]
    if key.startswith(AGENT_LABEL_PREFIX):
        return node.labels.get(key)
    return None


def ignored_labels(labels: Mapping[str, str]) -> tuple[str, ...]:
    """The keys of an agent's ``labels`` placement ignores (outside the prefix), sorted."""
    return tuple(sorted(k for k in labels if not k.startswith(AGENT_LABEL_PREFIX)))


def trusted_memory_bytes(capacity: NodeCapacity) -> int:
    """The node's unified memory placement counts: the claim, at most what the named chip can
    have."""
    return min(capacity.memory_total_bytes, _memory_bound(capacity.chip))


def trusted_generation(capacity: NodeCapacity) -> int:
    """The chip generation placement counts: the claim, at most the one the chip's name says
    (0 for a name that is no Apple M chip)."""
    return min(capacity.chip_generation, _generation_named(capacity.chip))


@dataclasses.dataclass(frozen=True)
class Claims:
    """What placement did not take from one node record as reported: ``ignored``: label keys;
    ``memory_claimed``/``memory_counted``: bytes (equal when the claim holds);
    ``generation_claimed``/``generation_counted``."""

    ignored: tuple[str, ...] = ()
    memory_claimed: int = 0
    memory_counted: int = 0
    generation_claimed: int = 0
    generation_counted: int = 0
    chip: str = ""

    @property
    def accepted(self) -> bool:
        """Every claim is used as reported."""
        return (not self.ignored and self.memory_claimed == self.memory_counted
                and self.generation_claimed == self.generation_counted)

    def message(self) -> str:
        """One sentence per claim not taken, or that all are (for the condition and the log)."""
        if self.accepted:
            return "placement uses the labels and capacity the agent reports"
        parts = []
        if self.ignored:
            named = ", ".join(self.ignored[:_MAX_NAMED])
            more = (f" and {len(self.ignored) - _MAX_NAMED} more"
                    if len(self.ignored) > _MAX_NAMED else "")
            parts.append(f"label(s) {named}{more} ignored for placement: an agent may set only "
                         f"{AGENT_LABEL_PREFIX} labels; label the MacNode instead")
        if self.memory_claimed != self.memory_counted:
            parts.append(f"memory {format_bytes(self.memory_claimed)} is more than a Mac with "
                         f"{self.chip or 'an unknown chip'} can have: placement counts "
                         f"{format_bytes(self.memory_counted)}")
        if self.generation_claimed != self.generation_counted:
            parts.append(f"chip generation {self.generation_claimed} is not what "
                         f"{self.chip or 'the chip name'} says: placement counts "
                         f"{self.generation_counted}")
        return "; ".join(parts)


def claims(node: NodeRecord) -> Claims:
    """The :class:`Claims` of ``node``'s record."""
    c = node.capacity
    return Claims(ignored=ignored_labels(node.labels), memory_claimed=c.memory_total_bytes,
                  memory_counted=trusted_memory_bytes(c),
                  generation_claimed=c.chip_generation, generation_counted=trusted_generation(c),
                  chip=c.chip)


def claims_condition(node: NodeRecord, *, generation: int = 0,
                     previous: Mapping[str, Any] | None = None, now: str = "") -> dict[str, Any]:
    """The MacNode's ``ClaimsAccepted`` condition: True ``AsReported``, or False
    ``ClaimsIgnored`` with :meth:`Claims.message`. ``previous``: the MacNode's status (keeps
    ``lastTransitionTime``); ``now``: RFC 3339 time of this observation."""
    found = claims(node)
    prev = {c.get("type"): c for c in (previous or {}).get("conditions") or []
            if isinstance(c, Mapping)}
    args = (("True", "AsReported") if found.accepted else ("False", "ClaimsIgnored"))
    return condition(CLAIMS_CONDITION, *args, found.message(), generation, prev,
                     now or "1970-01-01T00:00:00Z")
