"""Parsing of a ModelDeployment ``spec`` (camelCase, docs/modeldeployment-api.md) into plain data.

The CRD's OpenAPI schema already rejects most bad objects at ``kubectl apply``; this module is
the second line of defence for whatever gets past it (an older CRD, a schema bug, a client that
skips validation). Every problem surfaces as :class:`SpecError` (a ``ValueError``) naming the
field, which the handlers turn into a permanent error and a Warning event.

Pure: imports only the standard library, pydantic and :mod:`mlx_fleet.contract`.
"""

from __future__ import annotations

import re
from decimal import ROUND_CEILING, Decimal, InvalidOperation
from typing import Annotated, Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mlx_fleet.contract import (MIN_CHIP_GENERATION, Assignment, LifecyclePolicy, ModelSource,
                                ServingParams)


class SpecError(ValueError):
    """The spec is invalid; the message names the offending field."""


# ---------------------------------------------------------------------------------------------
# Kubernetes quantities
# ---------------------------------------------------------------------------------------------

#: Suffix → multiplier, as in k8s.io/apimachinery/pkg/api/resource (binary SI, decimal SI).
_SUFFIXES: dict[str, Decimal] = {
    "Ki": Decimal(1024), "Mi": Decimal(1024) ** 2, "Gi": Decimal(1024) ** 3,
    "Ti": Decimal(1024) ** 4, "Pi": Decimal(1024) ** 5, "Ei": Decimal(1024) ** 6,
    "m": Decimal("0.001"), "": Decimal(1),
    "k": Decimal(10) ** 3, "M": Decimal(10) ** 6, "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12, "P": Decimal(10) ** 15, "E": Decimal(10) ** 18,
}
_QUANTITY = re.compile(
    r"^(?P<sign>[+-]?)(?P<num>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
    r"(?:(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)|[eE](?P<exp>[+-]?[0-9]+))?$")


def parse_quantity(value: str | int | float) -> int:
    """A Kubernetes resource quantity → whole bytes, rounded up (like ``Quantity.Value()``).

    Accepts ints, and strings such as ``"2Gi"``, ``"512Mi"``, ``"1.5G"``, ``"1e9"``,
    ``"1500m"``. Raises ``ValueError`` for anything else, with the offending text.
    Negative quantities parse (the caller decides whether they are allowed).
    """
    if isinstance(value, bool):
        raise ValueError(f"invalid quantity {value!r}: expected a number or a string like '2Gi'")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        value = repr(value)
    if not isinstance(value, str):
        raise ValueError(f"invalid quantity {value!r}: expected a number or a string like '2Gi'")
    m = _QUANTITY.match(value.strip())
    if not m:
        raise ValueError(f"invalid quantity {value!r}: expected a number with an optional "
                         f"suffix (Ki, Mi, Gi, Ti, Pi, Ei, m, k, M, G, T, P, E) or exponent")
    try:
        num = Decimal(m["num"])
    except InvalidOperation as e:  # pragma: no cover - the regex admits only valid numbers
        raise ValueError(f"invalid quantity {value!r}") from e
    if m["exp"] is not None:
        exp = int(m["exp"])
        if abs(exp) > 60:
            raise ValueError(f"invalid quantity {value!r}: exponent out of range")
        num = num.scaleb(exp)
    else:
        num *= _SUFFIXES[m["suffix"] or ""]
    result = int(num.to_integral_value(rounding=ROUND_CEILING))
    return -result if m["sign"] == "-" else result


def format_bytes(n: int) -> str:
    """Bytes → a short human text in binary units with one decimal (``"1.5GiB"``)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            return f"{int(value)}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    raise AssertionError("unreachable")


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
    memory_bytes: int = Field(alias="memory")

    @field_validator("memory_bytes", mode="before")
    @classmethod
    def _memory(cls, v: Any) -> int:
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
    idle_unload_seconds: Annotated[int, Field(ge=0)] = Field(default=300, alias="idleUnloadSeconds")
    prefetch: Literal["Eager", "OnDemand"] = "Eager"


class DeploymentSpec(_Spec):
    """A validated ModelDeployment spec, defaults applied (docs/modeldeployment-api.md)."""

    model: ModelSpec
    replicas: Annotated[int, Field(ge=0, le=1000)] = 1
    resources: ResourcesSpec
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    serving: ServingSpec = Field(default_factory=ServingSpec)
    lifecycle: LifecycleSpec = Field(default_factory=LifecycleSpec)


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
    return "spec." + ".".join(aliases.get(str(p), str(p)) for p in loc)


def parse_spec(spec: Mapping[str, Any] | None) -> DeploymentSpec:
    """Validate a ModelDeployment ``spec`` dict. Raises :class:`SpecError` naming each bad field."""
    try:
        return DeploymentSpec.model_validate(dict(spec or {}))
    except ValidationError as e:
        problems = "; ".join(f"{_field_path(err['loc'])}: {err['msg']}" for err in e.errors())
        raise SpecError(f"invalid ModelDeployment spec: {problems}") from None


def to_assignment(spec: DeploymentSpec, *, namespace: str, name: str, uid: str = "",
                  generation: int = 0) -> Assignment:
    """The assignment every chosen node receives for this deployment (identical per node).

    ``served_model_name`` defaults to ``name`` (``metadata.name``).
    """
    return Assignment(
        namespace=namespace, name=name, uid=uid, generation=generation,
        served_model_name=spec.model.served_model_name or name,
        source=ModelSource(uri=spec.model.source, revision=spec.model.revision),
        memory_bytes=spec.resources.memory_bytes,
        serving=ServingParams(max_concurrent_sequences=spec.serving.max_concurrent_sequences,
                              max_context_tokens=spec.serving.max_context_tokens),
        lifecycle=LifecyclePolicy(idle_unload_seconds=spec.lifecycle.idle_unload_seconds,
                                  prefetch=spec.lifecycle.prefetch),
    )
