"""Parsing of a Canary ``spec`` (camelCase) into frozen pydantic models, defaults applied.

Shape (the CRD uses exactly these names; unknown keys are ignored, the API server prunes them)::

    targetRef: {name}                       a ModelDeployment in the Canary's namespace
    candidate: {revision, source?, memory?} source and memory default to the target's
    steps: [{setWeight: 0..100} | {pause: {duration?}}, ...]
    analysis: {interval, minRequests, failureLimit, checks: {...}, localGuard: {...}}

Every problem surfaces as :class:`CanarySpecError` (a ``ValueError``) naming each bad field as
``spec.<path>: <msg>``, e.g. ``spec.steps[2].setWeight``. The default thresholds are the ones
of issue #5 (error rate > 2 × stable, p95 latency and TTFT > 1.5 ×, per-sequence tokens/s
< 0.67 ×, memory growth > 20 %/h, crash rate > 0.1 %).

The models are also the one source of the Canary CRD's spec schema (descriptions, bounds,
defaults, CEL rules declared beside their fields with their Python ``check``):
``python -m mlx_fleet_operator.crd`` generates crds/mlx-fleet.io_canaries.yaml and
docs/canary-api.md from them. Durations default to their JSON text (``"10s"``), parsed.

Pure: imports only the standard library, pydantic, :mod:`mlx_fleet.contract` and the
operator's pure :mod:`.spec` and :mod:`.crd.markers`.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Annotated, Any, ClassVar, Mapping

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, ValidationError,
                      field_validator, model_validator)

from mlx_fleet.contract import LocalGuard

from .crd.markers import Int32, Rule, Wire
from .spec import Memory, Revision, Source, check_source, positive_memory


class CanarySpecError(ValueError):
    """The Canary spec is invalid; the message names every offending field."""


# ---------------------------------------------------------------------------------------------
# Durations
# ---------------------------------------------------------------------------------------------

_DURATION = re.compile(r"(?:(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:ms|s|m|h))+")
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(ms|s|m|h)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: str) -> float:
    """A Go-style duration string → seconds (``"500ms"`` → 0.5, ``"1m30s"`` → 90.0).

    Units: ``ms``, ``s``, ``m``, ``h``; parts are summed, decimals allowed (``"1.5h"``).
    Raises ``ValueError`` for anything else, including non-strings, signs and zero.
    """
    if not isinstance(value, str) or not _DURATION.fullmatch(value):
        raise ValueError(f"invalid duration {value!r}: expected e.g. '500ms', '10s', '5m', '1h', "
                         f"'1m30s'")
    seconds = sum(float(n) * _UNIT_SECONDS[u] for n, u in _DURATION_PART.findall(value))
    if seconds <= 0:
        raise ValueError(f"invalid duration {value!r}: must be greater than zero")
    return seconds


#: The durations the CRD takes: Go syntax, units ms/s/m/h, no sign (narrower than
#: :func:`parse_duration`, which also reads ``"1.s"`` and ``".5s"``).
DURATION_PATTERN = "^([0-9]+([.][0-9]+)?(ms|s|m|h))+$"
_UNIT_NS = {"ms": Decimal(10) ** 6, "s": Decimal(10) ** 9, "m": 60 * Decimal(10) ** 9,
            "h": 3600 * Decimal(10) ** 9}


def go_duration_ns(text: str) -> int | None:
    """Nanoseconds of a duration matching :data:`DURATION_PATTERN`, like CEL's ``duration()``
    (Go's ``time.ParseDuration``: truncated to whole nanoseconds); None where that errors
    (beyond 2**63 - 1 ns, about 292 years)."""
    total = sum(Decimal(n) * _UNIT_NS[u]
                for n, _, u in re.findall(r"([0-9]+([.][0-9]+)?)(ms|s|m|h)", text))
    return None if total > 2**63 - 1 else int(total)


DURATION_RULE = Rule(
    f"!self.matches('{DURATION_PATTERN}') || duration(self) > duration('0s')",
    "must be a positive duration such as 30s, 5m, 1h, 1m30s or 500ms",
    check=lambda v: re.search(DURATION_PATTERN, v) is None or (go_duration_ns(v) or 0) > 0)

#: A duration field: a Go-style string in the spec (and its default: declare
#: ``validate_default=True``), seconds (float) in the model.
Duration = Annotated[float, BeforeValidator(parse_duration),
                     Wire({"type": "string", "maxLength": 32, "pattern": DURATION_PATTERN}),
                     DURATION_RULE]

STEP_RULE = Rule("has(self.setWeight) != has(self.pause)",
                 "must set exactly one of setWeight or pause",
                 check=lambda v: ("setWeight" in v) != ("pause" in v))
WEIGHTS_RULE = Rule(
    "self.filter(s, has(s.setWeight)).map(s, s.setWeight).isSorted()",
    "setWeight may not decrease from one step to the next",
    check=lambda v: (lambda w: w == sorted(w))([s["setWeight"] for s in v if "setWeight" in s]))


class _At(ValueError):
    """A validation error about a field below the one being validated (``path`` from there)."""

    def __init__(self, path: tuple[str | int, ...], msg: str) -> None:
        super().__init__(msg)
        self.path = path


# ---------------------------------------------------------------------------------------------
# The spec
# ---------------------------------------------------------------------------------------------

class _Spec(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)


#: A Kubernetes object name (a DNS subdomain, RFC 1123).
DNS_SUBDOMAIN_PATTERN = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


class TargetRef(_Spec):
    name: Annotated[str, Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)] = Field(
        description=(
            "Name of a ModelDeployment in the Canary's namespace (a DNS subdomain of 1 to 253 "
            "characters). At most one active Canary per ModelDeployment: the operator enforces "
            "it, the schema cannot."))


class CandidateSpec(_Spec):
    """``source``/``memory_bytes`` None: the target ModelDeployment's own values."""

    revision: Revision = Field(description=(
        'Revision of the model to release (1 to 128 characters from A-Z, a-z, 0-9, ".", "_" and '
        '"-"). Must differ from the target\'s spec.model.revision: the operator enforces it, the '
        'schema cannot.'))
    source: Source | None = Field(default=None, description=(
        "Where the candidate's weights come from, with the same syntax as the ModelDeployment's "
        "spec.model.source. Default: the target's spec.model.source."))
    memory_bytes: Memory = Field(default=None, alias="memory", description=(
        'Unified memory one candidate replica needs, as a Kubernetes quantity such as "512Mi" or '
        '"2Gi"; must be greater than 0. Default: the target\'s spec.resources.memory.'))

    @field_validator("source")
    @classmethod
    def _source(cls, v: str | None) -> str | None:
        return None if v is None else check_source(v)  # the ModelDeployment's rule

    @field_validator("memory_bytes", mode="before")
    @classmethod
    def _memory(cls, v: Any) -> int | None:
        return positive_memory(v)


class PauseSpec(_Spec):
    """``duration_seconds`` None: wait for a manual promote."""

    duration_seconds: Duration | None = Field(default=None, alias="duration", description=(
        'How long to hold, as a positive Go duration ("30s", "5m", "1h", "1m30s", "500ms"). '
        'Absent: hold until a manual promote.'))


class Step(_Spec):
    """One step of the plan; sets exactly one of setWeight or pause."""

    crd_rules: ClassVar[tuple[Rule, ...]] = (STEP_RULE,)

    set_weight: Annotated[Int32, Field(ge=0, le=100)] | None = Field(
        default=None, alias="setWeight",
        description="Percent of the traffic sent to the candidate (0 to 100).")
    pause: PauseSpec | None = Field(default=None, description="Hold the current weight.")

    @model_validator(mode="after")
    def _one_key(self) -> Step:
        if (self.set_weight is None) == (self.pause is None):
            raise ValueError("must have exactly one key: setWeight or pause")
        return self


#: Issue #5's schedule: 1 % → 10 % → 50 % → 100 %, one analysis interval between steps.
DEFAULT_STEPS: tuple[Step, ...] = tuple(Step(set_weight=w) for w in (1, 10, 50, 100))

_ENABLED = "Run this check."
_RATIO = Annotated[float, Field(gt=0)]
_FRACTION = Annotated[float, Field(ge=0, le=1)]


class ErrorRateCheck(_Spec):
    """Fails when candidate errors/requests > ``max_ratio`` × max(stable rate, ``floor``), or,
    when ``max_absolute`` (spec ``max``, a ratio 0–1) is set, > ``max_absolute`` instead."""

    enabled: bool = Field(default=True, description=_ENABLED)
    max_ratio: _RATIO = Field(default=2.0, alias="maxRatio",
                              description="Largest candidate/stable error-rate ratio (> 0).")
    floor: _FRACTION = Field(default=0.01, description=(
        "Lowest stable error rate used in the ratio (0 to 1), so a stable revision without "
        "errors does not fail every candidate error."))
    max_absolute: _FRACTION | None = Field(default=None, alias="max", description=(
        "Largest candidate error rate (0 to 1); when set, replaces the maxRatio comparison."))


class LatencyCheck(_Spec):
    """Fails when candidate p95 > ``max_ratio`` × stable p95, or > ``max_seconds`` when set."""

    enabled: bool = Field(default=True, description=_ENABLED)
    max_ratio: _RATIO = Field(default=1.5, alias="maxRatio",
                              description="Largest candidate/stable p95 ratio (> 0).")
    max_seconds: _RATIO | None = Field(default=None, alias="maxSeconds", description=(
        "Largest candidate p95 in seconds (> 0); when set, replaces the maxRatio comparison."))


class TokensPerSecondCheck(_Spec):
    """Fails when candidate p50 per-sequence tokens/s < ``min_ratio`` × stable p50, or
    < ``min_absolute`` (spec ``min``) when set."""

    enabled: bool = Field(default=True, description=_ENABLED)
    min_ratio: Annotated[float, Field(gt=0, le=1)] = Field(
        default=0.67, alias="minRatio",
        description="Smallest candidate/stable rate ratio (> 0, at most 1).")
    min_absolute: _RATIO | None = Field(default=None, alias="min", description=(
        "Smallest candidate rate in tokens per second (> 0); when set, replaces the minRatio "
        "comparison."))


class MemoryGrowthCheck(_Spec):
    """Fails when the candidate's memory grows by more than ``max_per_hour`` (a fraction of its
    memory when the canary started) per hour."""

    enabled: bool = Field(default=True, description=_ENABLED)
    max_per_hour: _RATIO = Field(default=0.2, alias="maxPerHour", description=(
        "Largest growth per hour as a fraction of its memory at the start (> 0; 0.2 = 20% per "
        "hour)."))


class CrashRateCheck(_Spec):
    """Fails when candidate serving-core crashes / requests > ``max_per_request`` (spec ``max``)."""

    enabled: bool = Field(default=True, description=_ENABLED)
    max_per_request: _FRACTION = Field(default=0.001, alias="max",
                                       description="Largest candidate crash rate (0 to 1).")


class ChecksSpec(_Spec):
    error_rate: ErrorRateCheck = Field(default_factory=ErrorRateCheck, alias="errorRate", description=(
        "Server-side errors (5xx, streams ended by an error) per request. Fails when the "
        "candidate's rate exceeds maxRatio times the stable rate, where the stable rate counts as "
        "at least floor; or, when max is set, when it exceeds max."))
    latency_p95: LatencyCheck = Field(default_factory=LatencyCheck, alias="latencyP95",
                                      description="95th-percentile request latency, end to end.")
    ttft_p95: LatencyCheck = Field(default_factory=LatencyCheck, alias="ttftP95",
                                   description="95th-percentile time to first token.")
    tokens_per_second: TokensPerSecondCheck = Field(
        default_factory=TokensPerSecondCheck, alias="tokensPerSecond",
        description="Median decode rate per sequence (completion tokens per second).")
    memory_growth: MemoryGrowthCheck = Field(
        default_factory=MemoryGrowthCheck, alias="memoryGrowth",
        description="Growth of the candidate's resident memory while it runs.")
    crash_rate: CrashRateCheck = Field(
        default_factory=CrashRateCheck, alias="crashRate",
        description="Serving-core crashes that hit the candidate, per request.")


class LocalGuardSpec(_Spec):
    """The agent's fast rollback (see :class:`mlx_fleet.contract.LocalGuard`); defaults are
    the contract's."""

    enabled: bool = Field(default=True, description="Run the local guard.")
    window_seconds: Duration = Field(default="5s", validate_default=True, alias="window",
                                     description="The sliding window, a positive Go duration.")
    min_failures: Annotated[Int32, Field(ge=1)] = Field(default=3, alias="minFailures", description=(
        "Failed candidate requests in the window that may trip the guard (at least 1)."))
    failure_ratio: Annotated[float, Field(gt=0, le=1)] = Field(
        default=0.5, alias="failureRatio", description=(
            "Share of the candidate's requests in the window that must have failed (> 0, at most "
            "1)."))


class AnalysisSpec(_Spec):
    """``interval_seconds``: one analysis window (default 10 s). ``min_requests``: per revision
    per window; fewer makes the window Inconclusive (default 20). ``failure_limit``: failed
    windows in a row that roll back (default 1)."""

    interval_seconds: Duration = Field(
        default="10s", validate_default=True, alias="interval",
        description="Length of one analysis window, a positive Go duration.")
    min_requests: Annotated[Int32, Field(ge=1)] = Field(default=20, alias="minRequests", description=(
        "Requests each revision (stable and candidate) needs in a window for a verdict (at least "
        "1); fewer make the window Inconclusive."))
    failure_limit: Annotated[Int32, Field(ge=1)] = Field(
        default=1, alias="failureLimit",
        description="Failed windows in a row that roll the candidate back (at least 1).")
    checks: ChecksSpec = Field(default_factory=ChecksSpec, description=(
        "The comparisons run on each window. A ratio compares the candidate with the stable "
        "revision over the same window; a check's absolute limit (max, maxSeconds, min), when "
        "set, replaces its ratio and applies to the candidate alone. A check without data in the "
        "window is Inconclusive."))
    local_guard: LocalGuardSpec = Field(default_factory=LocalGuardSpec, alias="localGuard", description=(
        "Each agent's own fast rollback, without waiting for the operator: when within the last "
        "window the candidate has at least minFailures failed requests (server errors and "
        "crashes) and they are at least failureRatio of its requests, the agent sends all of the "
        "deployment's traffic on that Mac to the stable revision and reports it; the operator "
        "then rolls back."))


class CanarySpec(_Spec):
    """A validated Canary spec, defaults applied. ``steps``: 1–32 steps, setWeights
    non-decreasing; :data:`DEFAULT_STEPS` when omitted or empty."""

    target_ref: TargetRef = Field(alias="targetRef",
                                  description="The ModelDeployment to release a new revision of.")
    candidate: CandidateSpec = Field(description="The revision to release.")
    steps: Annotated[tuple[Step, ...], Field(max_length=32), WEIGHTS_RULE] = Field(
        default=DEFAULT_STEPS, description=(
            "The release plan, run in order (at most 32 steps). A setWeight step sends that "
            "percent of the traffic to the candidate and holds it for one analysis interval; a "
            "pause step holds the current weight for its duration, or until a manual promote when "
            "it has none. setWeight values may not decrease from one step to the next. After the "
            "last step the candidate is promoted. Default (when absent or empty): setWeight 1, "
            "10, 50, 100."))
    analysis: AnalysisSpec = Field(default_factory=AnalysisSpec, description=(
        "How the candidate is compared with the stable revision. Every interval the operator "
        "merges the agents' per-revision counters of the last window and runs each enabled "
        "check: a window fails when any check fails, and is Inconclusive when either revision "
        "had fewer than minRequests requests or a check had no data. failureLimit failed windows "
        "in a row roll the candidate back."))

    @field_validator("steps", mode="before")
    @classmethod
    def _default_steps(cls, v: Any) -> Any:
        return DEFAULT_STEPS if v is None or (isinstance(v, (list, tuple)) and not v) else v

    @field_validator("steps")
    @classmethod
    def _non_decreasing(cls, steps: tuple[Step, ...]) -> tuple[Step, ...]:
        last = 0
        for i, s in enumerate(steps):
            if s.set_weight is not None:
                if s.set_weight < last:
                    raise _At((i, "setWeight"), f"{s.set_weight} is below the previous "
                                                f"setWeight {last}: weights must not decrease")
                last = s.set_weight
        return steps


def _problem(err: Any) -> str:
    loc, msg = list(err["loc"]), err["msg"]
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, _At):
        loc, msg = loc + list(cause.path), str(cause)
    path = "spec" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)
    return f"{path}: {msg.removeprefix('Value error, ')}"


def parse_canary_spec(spec: Mapping[str, Any] | None) -> CanarySpec:
    """Validate a Canary ``spec`` dict. Raises :class:`CanarySpecError` naming each bad field
    (``spec.<path>: <msg>``, all of them, ``; ``-separated)."""
    try:
        return CanarySpec.model_validate(dict(spec or {}))
    except ValidationError as e:
        problems = "; ".join(_problem(err) for err in e.errors())
        raise CanarySpecError(f"invalid Canary spec: {problems}") from None


def to_local_guard(spec: CanarySpec | LocalGuardSpec) -> LocalGuard:
    """The :class:`~mlx_fleet.contract.LocalGuard` to put into the TrafficSplit."""
    g = spec.analysis.local_guard if isinstance(spec, CanarySpec) else spec
    return LocalGuard(enabled=g.enabled, window_seconds=g.window_seconds,
                      min_failures=g.min_failures, failure_ratio=g.failure_ratio)
