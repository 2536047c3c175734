"""Parsing of a ModelDeployment ``spec`` (camelCase, docs/modeldeployment-api.md) into plain data.

The CRD's OpenAPI schema already rejects most bad objects at ``kubectl apply``; this module is
the second line of defence for whatever gets past it (an older CRD, a schema bug, a client that
skips validation). Every problem surfaces as :class:`SpecError` (a ``ValueError``) naming the
field, which the handlers turn into a permanent error and a Warning event.

Pure: imports only the standard library, pydantic and :mod:`mlx_fleet.contract`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mlx_fleet.contract import (MIN_CHIP_GENERATION, Assignment, LifecyclePolicy, ModelSource,
                                Role, ServingParams)
from mlx_fleet.quantity import format_bytes, parse_quantity

__all__ = ["SpecError", "DeploymentSpec", "parse_spec", "to_assignment", "parse_quantity",
           "format_bytes", "parse_chip_generation", "resolve_int_or_percent", "pin_replicas"]


class SpecError(ValueError):
    """The spec is invalid; the message names the offending field."""


# ---------------------------------------------------------------------------------------------
# The spec
# ---------------------------------------------------------------------------------------------

class _Spec(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)


class ModelSpec(_Spec):
    source: Annotated[str, Field(min_length=2)]
    revision: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")]
    served_model_name: str | None = Field(default=None, alias="servedModelName")

    @field_validator("source")
    @classmethod
    def _source(cls, v: str) -> str:
        if not re.match(r"^(file://)?/.+|^hf://[^/]+/[^/]+$|^https://.+", v):
            raise ValueError("must be file:///abs/path, /abs/path, hf://org/repo or https://...")
        return v


class ResourcesSpec(_Spec):
    """``memory``: the user's override of a replica's unified memory (bytes); None when unset —
    placement then uses the agents' estimate (:func:`~.placement.resolve_memory`)."""

    memory_bytes: int | None = Field(default=None, alias="memory")

    @field_validator("memory_bytes", mode="before")
    @classmethod
    def _memory(cls, v: Any) -> int | None:
        if v is None:
            return None
        n = parse_quantity(v)
        if n <= 0:
            raise ValueError(f"must be greater than zero, got {v!r}")
        return n


class PlacementSpec(_Spec):
    node_selector: dict[str, str] = Field(default_factory=dict, alias="nodeSelector")
    min_chip_generation: int = Field(default=MIN_CHIP_GENERATION, alias="minChipGeneration")
    strategy: Literal["Spread", "Binpack"] = "Spread"

    @field_validator("min_chip_generation", mode="before")
    @classmethod
    def _chip(cls, v: Any) -> int:
        return parse_chip_generation(v)


class ServingSpec(_Spec):
    max_concurrent_sequences: Annotated[int, Field(ge=1, le=256)] = Field(
        default=8, alias="maxConcurrentSequences")
    max_context_tokens: Annotated[int, Field(ge=128, le=1048576)] = Field(
        default=4096, alias="maxContextTokens")


class LifecycleSpec(_Spec):
    """``minReady``: replicas kept resident whatever their idleness or the node's memory
    pressure (0..``replicas``; the first ones by node name are pinned, :func:`pin_replicas`)."""

    idle_unload_seconds: Annotated[int, Field(ge=0)] = Field(default=300, alias="idleUnloadSeconds")
    prefetch: Literal["Eager", "OnDemand"] = "Eager"
    min_ready: Annotated[int, Field(ge=0)] = Field(default=0, alias="minReady")


IntOrPercent = Annotated[int, Field(ge=0)] | Annotated[str, Field(pattern=r"^[0-9]{1,3}%$")]


class RollingUpdateSpec(_Spec):
    """``maxSurge``: extra nodes a rollout may load the new revision on beyond ``replicas``
    (an int or a percent of ``replicas``, rounded up; default ``"25%"`` as for Deployments).
    ``maxUnavailable``: Ready replicas a rollout may take down at once — used only where memory
    leaves no room for a surge (default 1, percents rounded down). The rollout always prefers
    loading the new revision next to the old one on the same node."""

    max_surge: IntOrPercent = Field(default="25%", alias="maxSurge")
    max_unavailable: IntOrPercent = Field(default=1, alias="maxUnavailable")


class StrategySpec(_Spec):
    type: Literal["RollingUpdate"] = "RollingUpdate"
    rolling_update: RollingUpdateSpec = Field(default_factory=RollingUpdateSpec,
                                              alias="rollingUpdate")


def resolve_int_or_percent(value: int | str, total: int, *, round_up: bool) -> int:
    """An int-or-percent against ``total`` (Kubernetes ``intstr.GetScaledValueFromIntOrPercent``):
    ``"25%"`` of 3 is 1 rounded up, 0 rounded down; an int is itself."""
    if isinstance(value, int):
        return value
    pct = int(value.rstrip("%"))
    return -(-pct * total // 100) if round_up else pct * total // 100


class DeploymentSpec(_Spec):
    """A validated ModelDeployment spec, defaults applied (docs/modeldeployment-api.md)."""

    model: ModelSpec
    replicas: Annotated[int, Field(ge=0, le=1000)] = 1
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    serving: ServingSpec = Field(default_factory=ServingSpec)
    lifecycle: LifecycleSpec = Field(default_factory=LifecycleSpec)
    strategy: StrategySpec = Field(default_factory=StrategySpec)

    @model_validator(mode="after")
    def _min_ready(self) -> DeploymentSpec:
        if self.lifecycle.min_ready > self.replicas:
            raise ValueError(f"spec.lifecycle.minReady ({self.lifecycle.min_ready}) must not "
                             f"exceed spec.replicas ({self.replicas})")
        return self

    def surge_limits(self) -> tuple[int, int]:
        """``(max_surge, max_unavailable)`` resolved against ``replicas``. When both come out
        0 (e.g. ``"10%"`` of 1 replica rounded down and ``maxSurge: 0``), a surge of 1 is
        allowed, as the Deployment controller does, so a rollout can always progress."""
        ru = self.strategy.rolling_update
        surge = resolve_int_or_percent(ru.max_surge, self.replicas, round_up=True)
        unavailable = resolve_int_or_percent(ru.max_unavailable, self.replicas, round_up=False)
        if surge == 0 and unavailable == 0:
            surge = 1
        return surge, unavailable


def parse_chip_generation(value: Any) -> int:
    """``"M3"`` → 3, ``"M4"`` → 4 ... (also accepts a plain int). Raises ``ValueError``."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"[Mm]([0-9]{1,2})", value.strip())
        if m:
            return int(m[1])
    raise ValueError(f"invalid chip generation {value!r}: expected M3, M4, M5 ...")


def _field_path(loc: tuple[Any, ...]) -> str:
    aliases = {"memory_bytes": "memory"}
    # pydantic names union members in the location (``int``, ``constrained-str``): drop them
    parts = [aliases.get(str(p), str(p)) for p in loc
             if not (isinstance(p, str) and (p in {"int", "str"} or "constrained" in p
                                             or "function-" in p))]
    return "spec." + ".".join(parts)


def parse_spec(spec: Mapping[str, Any] | None) -> DeploymentSpec:
    """Validate a ModelDeployment ``spec`` dict. Raises :class:`SpecError` naming each bad field."""
    try:
        return DeploymentSpec.model_validate(dict(spec or {}))
    except ValidationError as e:
        problems = "; ".join(f"{_field_path(err['loc'])}: {err['msg']}" if err["loc"]
                             else err["msg"].removeprefix("Value error, ") for err in e.errors())
        raise SpecError(f"invalid ModelDeployment spec: {problems}") from None


def to_assignment(spec: DeploymentSpec, *, namespace: str, name: str, uid: str = "",
                  generation: int = 0, role: Role = Role.STABLE, source: str | None = None,
                  revision: str | None = None, memory_bytes: int | None = None) -> Assignment:
    """The assignment every chosen node receives for one revision of this deployment
    (identical per node): by default the spec's own revision as ``Stable``; a Canary's candidate
    passes ``role=Role.CANDIDATE`` and its ``source``/``revision``/``memory_bytes``.
    ``memory_bytes`` (the bytes placement reserved: the override or the agents' estimate) falls
    back to ``spec.resources.memory``, else 0 (no figure yet).

    ``served_model_name`` defaults to ``name`` (``metadata.name``).
    """
    return Assignment(
        namespace=namespace, name=name, uid=uid, generation=generation, role=role,
        served_model_name=spec.model.served_model_name or name,
        source=ModelSource(uri=source or spec.model.source,
                           revision=revision or spec.model.revision),
        memory_bytes=memory_bytes or spec.resources.memory_bytes or 0,
        serving=ServingParams(max_concurrent_sequences=spec.serving.max_concurrent_sequences,
                              max_context_tokens=spec.serving.max_context_tokens),
        lifecycle=LifecyclePolicy(idle_unload_seconds=spec.lifecycle.idle_unload_seconds,
                                  prefetch=spec.lifecycle.prefetch),
    )


def pin_replicas(desired: Mapping[tuple[str, str], Assignment], *, revision: str, min_ready: int,
                 stored: Mapping[tuple[str, str], Assignment],
                 same: Callable[[Assignment, Assignment], bool]) -> dict[tuple[str, str], Assignment]:
    """``desired`` ((node, revision) → assignment) with ``lifecycle.pinned`` set on the first
    ``min_ready`` Stable assignments of ``revision`` by node name (a stable order: the same
    replicas stay pinned from one reconcile to the next) and cleared on the others.

    ``stored``: the records etcd holds; where one is ``same`` as the pinned record (e.g.
    :func:`~mlx_fleet_operator.rollout.same_for_node`: equal but for the generation), it is
    kept as it is, so pinning writes only when a replica's pin actually changes. Pure.
    """
    slots = sorted(s for s, a in desired.items() if s[1] == revision and a.role == Role.STABLE)
    pinned = set(slots[:max(min_ready, 0)])
    out = dict(desired)
    for slot in slots:
        a = out[slot]
        if a.lifecycle.pinned == (slot in pinned):
            continue
        a = a.model_copy(update={"lifecycle": a.lifecycle.model_copy(
            update={"pinned": slot in pinned})})
        have = stored.get(slot)
        out[slot] = have if have is not None and same(have, a) else a
    return out
