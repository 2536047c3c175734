"""Parsing of a ModelDeployment ``spec`` (camelCase, docs/modeldeployment-api.md) into plain data.

The CRD's OpenAPI schema already rejects most bad objects at ``kubectl apply``; this module is
the second line of defence for whatever gets past it (an older CRD, a schema bug, a client that
skips validation). Every problem surfaces as :class:`SpecError` (a ``ValueError``) naming the
field, which the handlers turn into a permanent error and a Warning event.

The models are also the one source of the CRD's spec schema: descriptions, bounds, defaults and
the CEL rules (each :class:`~.crd.markers.Rule` declared beside its field, with the same
predicate in Python as ``check``) become crds/mlx-fleet.io_modeldeployments.yaml and
docs/modeldeployment-api.md through ``python -m mlx_fleet_operator.crd``. A field's default is
its JSON value (``"M3"``; parsed with ``validate_default=True``).

Pure: imports only the standard library, pydantic, :mod:`mlx_fleet.contract`,
:mod:`mlx_fleet.capabilities` (the task vocabulary),
:mod:`mlx_fleet.quantity` and :mod:`.crd.markers`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mlx_fleet.capabilities import TASK_TEXT_GENERATION, Task
from mlx_fleet.contract import (MIN_CHIP_GENERATION, Assignment, LifecyclePolicy, ModelSource,
                                Role, ServingParams)
from mlx_fleet.quantity import format_bytes, parse_quantity

from .crd.markers import INT_OR_STRING, QUANTITY_PATTERN, Int32, Int64, Keywords, Rule, Wire

__all__ = ["SpecError", "DeploymentSpec", "parse_spec", "to_assignment", "parse_quantity",
           "format_bytes", "parse_chip_generation", "resolve_int_or_percent", "pin_replicas",
           "Revision", "Source", "Memory", "check_source", "positive_memory", "SOURCE_RULE",
           "MEMORY_RULE"]


class SpecError(ValueError):
    """The spec is invalid; the message names the offending field."""


# ---------------------------------------------------------------------------------------------
# The CEL rules of the schema (crds/ is generated from the models below: python -m
# mlx_fleet_operator.crd). Each rule's ``check`` is the same predicate in Python over the JSON.
# ---------------------------------------------------------------------------------------------

SOURCE_PATTERN = r"^(file://)?/.+|^hf://[^/]+/[^/]+$|^https://.+"
SOURCE_RULE = Rule(
    f"self.matches('{SOURCE_PATTERN}')",
    'must be an absolute path ("/abs/path" or "file:///abs/path"), "hf://<org>/<repo>" or an '
    '"https://" URL',
    check=lambda v: re.search(SOURCE_PATTERN, v) is not None)


def _positive_quantity(v: Any) -> bool:
    try:
        return parse_quantity(v) > 0
    except ValueError:
        return False


MEMORY_RULE = Rule(
    "type(self) == int ? self > 0 : (isQuantity(self) && quantity(self).isGreaterThan(quantity('0')))",
    "must be a Kubernetes quantity greater than 0, such as 512Mi or 2Gi",
    check=_positive_quantity)

LABEL_KEY_PATTERN = ("^([a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                     "[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
LABEL_KEYS_RULE = Rule(
    f"self.all(k, k.matches('{LABEL_KEY_PATTERN}') && (!k.contains('/') || k.indexOf('/') <= 253))",
    'keys must be Kubernetes label keys: an optional DNS-subdomain prefix of at most 253 '
    'characters and "/", then a name of at most 63 characters (letters, digits, "-", "_", "." '
    'inside, letters or digits at both ends)',
    check=lambda v: all(re.search(LABEL_KEY_PATTERN, k) and ("/" not in k or k.index("/") <= 253)
                        for k in v))

SURGE_PATTERN = "^[0-9]{1,3}%$"
UNAVAILABLE_PATTERN = "^([0-9]{1,2}|100)%$"
_ZERO_PERCENT = "^0+%$"


def _is_zero(v: int | str) -> bool:
    return v == 0 if isinstance(v, int) else re.search(_ZERO_PERCENT, v) is not None


SURGE_RULE = Rule(
    f"type(self) == int ? self >= 0 : self.matches('{SURGE_PATTERN}')",
    'must be an integer >= 0 or a percentage such as "25%"',
    check=lambda v: v >= 0 if isinstance(v, int) else re.search(SURGE_PATTERN, v) is not None)
UNAVAILABLE_RULE = Rule(
    f"type(self) == int ? self >= 0 : self.matches('{UNAVAILABLE_PATTERN}')",
    'must be an integer >= 0 or a percentage from "0%" to "100%"',
    check=lambda v: v >= 0 if isinstance(v, int) else re.search(UNAVAILABLE_PATTERN, v) is not None)
NOT_BOTH_ZERO_RULE = Rule(
    "!has(self.maxSurge) || !has(self.maxUnavailable) || "
    f"!((type(self.maxSurge) == int ? self.maxSurge == 0 : self.maxSurge.matches('{_ZERO_PERCENT}')) && "
    f"(type(self.maxUnavailable) == int ? self.maxUnavailable == 0 : "
    f"self.maxUnavailable.matches('{_ZERO_PERCENT}')))",
    "maxSurge and maxUnavailable may not both be 0",
    check=lambda v: "maxSurge" not in v or "maxUnavailable" not in v
    or not (_is_zero(v["maxSurge"]) and _is_zero(v["maxUnavailable"])))
MIN_READY_RULE = Rule(
    "!has(self.lifecycle) || !has(self.lifecycle.minReady) || self.lifecycle.minReady == 0 || "
    "self.lifecycle.minReady <= (has(self.replicas) ? self.replicas : 1)",
    "must not exceed spec.replicas (minReady replicas are pinned resident)",
    field_path=".lifecycle.minReady", reason="FieldValueInvalid",
    check=lambda v: (v.get("lifecycle", {}).get("minReady", 0) == 0
                     or v.get("lifecycle", {}).get("minReady", 0) <= v.get("replicas", 1)))


# ---------------------------------------------------------------------------------------------
# The spec
# ---------------------------------------------------------------------------------------------

class _Spec(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)


#: A model revision (shared by a Canary's candidate).
Revision = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")]
#: Where model weights come from (shared by a Canary's candidate).
Source = Annotated[str, Field(min_length=1, max_length=2048), SOURCE_RULE]
#: Unified memory in bytes, given as a Kubernetes quantity (an int-or-string) greater than 0
#: (shared by a Canary's candidate); None: unset.
Memory = Annotated[int | None, Wire({**INT_OR_STRING, "pattern": QUANTITY_PATTERN}), MEMORY_RULE]


def check_source(v: str) -> str:
    """``v`` when it passes :data:`SOURCE_RULE`; raises ``ValueError`` otherwise."""
    if not SOURCE_RULE.check(v):
        raise ValueError("must be file:///abs/path, /abs/path, hf://org/repo or https://...")
    return v


def positive_memory(v: Any) -> int | None:
    """A memory quantity → bytes (None stays None); raises ``ValueError`` unless > 0."""
    if v is None:
        return None
    n = parse_quantity(v)
    if n <= 0:
        raise ValueError(f"must be greater than zero, got {v!r}")
    return n


class ModelSpec(_Spec):
    source: Source = Field(description=(
        'Where the model weights come from: "file:///abs/path" or "/abs/path" (a directory on '
        'every Mac), "hf://org/repo" (Hugging Face, through huggingface_hub) or "https://..." (a '
        'mirror with a manifest.json).'))
    revision: Revision = Field(description=(
        'Revision of the model (1 to 128 characters from A-Z, a-z, 0-9, ".", "_" and "-"). '
        'Changing it rolls the deployment to the new weights.'))
    served_model_name: Annotated[
        str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
    ] | None = Field(default=None, alias="servedModelName", description=(
        'The model id clients pass as "model" to the OpenAI-compatible API (1 to 128 characters: '
        'a letter or digit, then letters, digits, ".", "_", ":", "/" and "-"). Defaults to '
        'metadata.name when unset.'))
    task: Task = Field(default=TASK_TEXT_GENERATION, description=(
        'What the model is served for: TextGeneration (POST /v1/chat/completions and '
        '/v1/completions) or TextEmbedding (POST /v1/embeddings: the hidden state of the last '
        'input token, L2-normalised, unless the model directory\'s sentence-transformers pooling '
        'config says otherwise). A request for the other task is refused with 400. The names are '
        'KubeAI\'s model features; one task per model, as vLLM\'s --task.'))

    @field_validator("source")
    @classmethod
    def _source(cls, v: str) -> str:
        return check_source(v)


class ResourcesSpec(_Spec):
    """``memory``: the user's override of a replica's unified memory (bytes); None when unset —
    placement then uses the agents' estimate (:func:`~.placement.resolve_memory`)."""

    memory_bytes: Memory = Field(default=None, alias="memory", description=(
        'Unified memory one replica needs (weights plus KV cache), as a Kubernetes quantity such '
        'as "512Mi" or "2Gi"; must be greater than 0. Optional: the user\'s override. When unset, '
        'placement uses the largest estimate the agents reported for the revision (weights from '
        'the safetensors headers plus the KV cache at the serving limits), and places one replica '
        'first to get it.'))

    @field_validator("memory_bytes", mode="before")
    @classmethod
    def _memory(cls, v: Any) -> int | None:
        return positive_memory(v)


class PlacementSpec(_Spec):
    node_selector: Annotated[
        dict[str, Annotated[str, Field(max_length=63,
                                       pattern=r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")]],
        Field(max_length=64), LABEL_KEYS_RULE,
    ] = Field(default_factory=dict, alias="nodeSelector", description=(
        'Node labels that must all match for a Mac to be eligible (at most 64). Keys and values '
        'follow the Kubernetes label syntax: a key is an optional DNS-subdomain prefix of up to '
        '253 characters and "/", then a name of up to 63 characters; a value has up to 63 '
        'characters (letters, digits, "-", "_" and "." inside, letters or digits at both ends) or '
        'is empty.'))
    min_chip_generation: Annotated[int, Wire({"type": "string", "enum": ["M3", "M4", "M5"]})] = Field(
        default=f"M{MIN_CHIP_GENERATION}", validate_default=True, alias="minChipGeneration",
        description="Oldest Apple-Silicon generation eligible (M3, M4 or M5).")
    strategy: Literal["Spread", "Binpack"] = Field(default="Spread", description=(
        "Spread puts replicas on the Macs with the most free memory, one per Mac; Binpack fills "
        "the fullest Macs that still fit first."))

    @field_validator("min_chip_generation", mode="before")
    @classmethod
    def _chip(cls, v: Any) -> int:
        return parse_chip_generation(v)


class ServingSpec(_Spec):
    max_concurrent_sequences: Annotated[Int32, Field(ge=1, le=256)] = Field(
        default=8, alias="maxConcurrentSequences",
        description="Maximum sequences decoded together in one batch (1 to 256).")
    max_context_tokens: Annotated[Int32, Field(ge=128, le=1048576)] = Field(
        default=4096, alias="maxContextTokens",
        description="Maximum prompt plus completion tokens per request (128 to 1048576).")


class LifecycleSpec(_Spec):
    """``minReady``: replicas kept resident whatever their idleness or the node's memory
    pressure (0..``replicas``; the first ones by node name are pinned, :func:`pin_replicas`)."""

    idle_unload_seconds: Annotated[Int64, Field(ge=0)] = Field(
        default=300, alias="idleUnloadSeconds", description=(
            "Unload a replica after this many seconds without requests, freeing its memory; 0 "
            "means never unload. An unloaded replica stays assigned (standby): the next request "
            "reloads it."))
    min_ready: Annotated[Int32, Field(ge=0)] = Field(default=0, alias="minReady", description=(
        "Replicas kept resident (pinned) whatever their idleness or their Mac's memory pressure: "
        "never idle-unloaded, never evicted. The first minReady replicas by node name are "
        "pinned. 0 to spec.replicas."))
    prefetch: Literal["Eager", "OnDemand"] = Field(default="Eager", description=(
        "Eager fetches, verifies and loads weights as soon as a Mac is assigned; OnDemand "
        "fetches and loads them at the first request (the replica is standby until then)."))


IntOrPercent = Annotated[int, Field(ge=0)] | Annotated[str, Field(pattern=SURGE_PATTERN)]


class RollingUpdateSpec(_Spec):
    """``maxSurge``: extra nodes a rollout may load the new revision on beyond ``replicas``
    (an int or a percent of ``replicas``, rounded up; default ``"25%"`` as for Deployments).
    ``maxUnavailable``: Ready replicas a rollout may take down at once — used only where memory
    leaves no room for a surge (default 1, percents rounded down). The rollout always prefers
    loading the new revision next to the old one on the same node."""

    crd_rules: ClassVar[tuple[Rule, ...]] = (NOT_BOTH_ZERO_RULE,)

    max_surge: Annotated[IntOrPercent, Keywords(maxLength=4), SURGE_RULE] = Field(
        default="25%", alias="maxSurge", description=(
            'Extra Macs that may host the new revision during a rollout, beyond spec.replicas: an '
            'integer >= 0 or a percentage of spec.replicas such as "25%" (rounded up). Default '
            '"25%".'))
    max_unavailable: Annotated[IntOrPercent, Keywords(maxLength=4), UNAVAILABLE_RULE] = Field(
        default=1, alias="maxUnavailable", description=(
            'Ready replicas a rollout may take down at once: an integer >= 0 or a percentage of '
            'spec.replicas from "0%" to "100%" (rounded down). Used only where memory allows no '
            'surge (the two revisions never fit on one Mac together and no spare Mac is '
            'eligible). Default 1.'))


class StrategySpec(_Spec):
    type: Literal["RollingUpdate"] = Field(
        default="RollingUpdate", description="The rollout strategy; RollingUpdate is the only one.")
    rolling_update: RollingUpdateSpec = Field(
        default_factory=RollingUpdateSpec, alias="rollingUpdate", description=(
            "Limits of a rolling update. maxSurge and maxUnavailable may not both be 0. "
            "Percentages are of spec.replicas; when both resolve to 0 for the current replica "
            'count (e.g. maxSurge 0 and maxUnavailable "10%" of 3 replicas), a surge of 1 is used '
            "so that a rollout can always progress, as the Deployment controller does."))


def resolve_int_or_percent(value: int | str, total: int, *, round_up: bool) -> int:
    """An int-or-percent against ``total`` (Kubernetes ``intstr.GetScaledValueFromIntOrPercent``):
    ``"25%"`` of 3 is 1 rounded up, 0 rounded down; an int is itself."""
    if isinstance(value, int):
        return value
    pct = int(value.rstrip("%"))
    return -(-pct * total // 100) if round_up else pct * total // 100


class DeploymentSpec(_Spec):
    """A validated ModelDeployment spec, defaults applied (docs/modeldeployment-api.md)."""

    crd_rules: ClassVar[tuple[Rule, ...]] = (MIN_READY_RULE,)

    model: ModelSpec = Field(description="The model to serve.")
    replicas: Annotated[Int32, Field(ge=0, le=1000)] = Field(
        default=1, description="Number of Macs that should serve this model (0 to 1000).")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec,
                                     description="Resources each replica needs on its Mac.")
    placement: PlacementSpec = Field(default_factory=PlacementSpec, description=(
        "Which Macs may serve replicas and how replicas are spread over them."))
    serving: ServingSpec = Field(default_factory=ServingSpec,
                                 description="Serving limits of each replica.")
    lifecycle: LifecycleSpec = Field(default_factory=LifecycleSpec,
                                     description="When weights are fetched, loaded and unloaded.")
    strategy: StrategySpec = Field(default_factory=StrategySpec, description=(
        "How a change of spec.model (a new revision) rolls out over the replicas, with the "
        "semantics of a Deployment's rolling update. The rollout always prefers loading the new "
        "revision next to the old one on the same Mac (both resident until the new one is Ready "
        "there, then the old one is unloaded); it takes replicas down only where memory leaves no "
        "room for that."))

    @model_validator(mode="after")
    def _min_ready(self) -> DeploymentSpec:
        if self.lifecycle.min_ready > self.replicas:
            raise ValueError(f"spec.lifecycle.minReady ({self.lifecycle.min_ready}) must not "
                             f"exceed spec.replicas ({self.replicas})")
        return self

    def served_name(self, name: str) -> str:
        """The model id clients send for this deployment (the OpenAI ``model``):
        ``model.servedModelName``, else ``name`` (the object's ``metadata.name``). The one
        definition: assignments, traffic splits, placement and ``status.router`` use it."""
        return self.model.served_model_name or name

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

    ``served_model_name``: :meth:`DeploymentSpec.served_name`.
    """
    return Assignment(
        namespace=namespace, name=name, uid=uid, generation=generation, role=role,
        served_model_name=spec.served_name(name),
        source=ModelSource(uri=source or spec.model.source,
                           revision=revision or spec.model.revision),
        memory_bytes=memory_bytes or spec.resources.memory_bytes or 0,
        serving=ServingParams(max_concurrent_sequences=spec.serving.max_concurrent_sequences,
                              max_context_tokens=spec.serving.max_context_tokens),
        lifecycle=LifecyclePolicy(idle_unload_seconds=spec.lifecycle.idle_unload_seconds,
                                  prefetch=spec.lifecycle.prefetch),
        task=spec.model.task,
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
