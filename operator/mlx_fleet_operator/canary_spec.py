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

Pure: imports only the standard library, pydantic and :mod:`mlx_fleet.contract`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Mapping

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, ValidationError,
                      field_validator, model_validator)

from mlx_fleet.contract import LocalGuard

from .spec import ModelSpec, parse_quantity


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


#: A duration field: a Go-style string in the spec, seconds (float) in the model.
Duration = Annotated[float, BeforeValidator(parse_duration)]


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


class TargetRef(_Spec):
    name: Annotated[str, Field(min_length=1)]


class CandidateSpec(_Spec):
    """``source``/``memory_bytes`` None: the target ModelDeployment's own values."""

    revision: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")]
    source: str | None = None
    memory_bytes: int | None = Field(default=None, alias="memory")

    @field_validator("source")
    @classmethod
    def _source(cls, v: str | None) -> str | None:
        return None if v is None else ModelSpec._source(v)  # the ModelDeployment's rule

    @field_validator("memory_bytes", mode="before")
    @classmethod
    def _memory(cls, v: Any) -> int | None:
        if v is None:
            return None
        n = parse_quantity(v)
        if n <= 0:
            raise ValueError(f"must be greater than zero, got {v!r}")
        return n


class PauseSpec(_Spec):
    """``duration_seconds`` None: wait for a manual promote."""

    duration_seconds: Duration | None = Field(default=None, alias="duration")


class Step(_Spec):
    """Exactly one of ``set_weight`` (candidate percent, 0–100) and ``pause``."""

    set_weight: Annotated[int, Field(ge=0, le=100)] | None = Field(default=None, alias="setWeight")
    pause: PauseSpec | None = None

    @model_validator(mode="after")
    def _one_key(self) -> Step:
        if (self.set_weight is None) == (self.pause is None):
            raise ValueError("must have exactly one key: setWeight or pause")
        return self


#: Issue #5's schedule: 1 % → 10 % → 50 % → 100 %, one analysis interval between steps.
DEFAULT_STEPS: tuple[Step, ...] = tuple(Step(set_weight=w) for w in (1, 10, 50, 100))


class ErrorRateCheck(_Spec):
    """Fails when candidate errors/requests > ``max_ratio`` × max(stable rate, ``floor``), or,
    when ``max_absolute`` (spec ``max``, a ratio 0–1) is set, > ``max_absolute`` instead."""

    enabled: bool = True
    max_ratio: Annotated[float, Field(gt=0)] = Field(default=2.0, alias="maxRatio")
    floor: Annotated[float, Field(ge=0, le=1)] = 0.01
    max_absolute: Annotated[float, Field(ge=0, le=1)] | None = Field(default=None, alias="max")


class LatencyCheck(_Spec):
    """Fails when candidate p95 > ``max_ratio`` × stable p95, or > ``max_seconds`` when set."""

    enabled: bool = True
    max_ratio: Annotated[float, Field(gt=0)] = Field(default=1.5, alias="maxRatio")
    max_seconds: Annotated[float, Field(gt=0)] | None = Field(default=None, alias="maxSeconds")


class TokensPerSecondCheck(_Spec):
    """Fails when candidate p50 per-sequence tokens/s < ``min_ratio`` × stable p50, or
    < ``min_absolute`` (spec ``min``) when set."""

    enabled: bool = True
    min_ratio: Annotated[float, Field(gt=0)] = Field(default=0.67, alias="minRatio")
    min_absolute: Annotated[float, Field(gt=0)] | None = Field(default=None, alias="min")


class MemoryGrowthCheck(_Spec):
    """Fails when the candidate's memory grows by more than ``max_per_hour`` (a fraction of its
    memory when the canary started) per hour."""

    enabled: bool = True
    max_per_hour: Annotated[float, Field(gt=0)] = Field(default=0.2, alias="maxPerHour")


class CrashRateCheck(_Spec):
    """Fails when candidate serving-core crashes / requests > ``max_per_request`` (spec ``max``)."""

    enabled: bool = True
    max_per_request: Annotated[float, Field(ge=0, le=1)] = Field(default=0.001, alias="max")


class ChecksSpec(_Spec):
    error_rate: ErrorRateCheck = Field(default_factory=ErrorRateCheck, alias="errorRate")
    latency_p95: LatencyCheck = Field(default_factory=LatencyCheck, alias="latencyP95")
    ttft_p95: LatencyCheck = Field(default_factory=LatencyCheck, alias="ttftP95")
    tokens_per_second: TokensPerSecondCheck = Field(default_factory=TokensPerSecondCheck,
                                                    alias="tokensPerSecond")
    memory_growth: MemoryGrowthCheck = Field(default_factory=MemoryGrowthCheck,
                                             alias="memoryGrowth")
    crash_rate: CrashRateCheck = Field(default_factory=CrashRateCheck, alias="crashRate")


class LocalGuardSpec(_Spec):
    """The agent's fast rollback (see :class:`mlx_fleet.contract.LocalGuard`); defaults are
    the contract's."""

    enabled: bool = True
    window_seconds: Duration = Field(default=5.0, alias="window")
    min_failures: Annotated[int, Field(ge=1)] = Field(default=3, alias="minFailures")
    failure_ratio: Annotated[float, Field(gt=0, le=1)] = Field(default=0.5, alias="failureRatio")


class AnalysisSpec(_Spec):
    """``interval_seconds``: one analysis window (default 10 s). ``min_requests``: per revision
    per window; fewer makes the window Inconclusive (default 20). ``failure_limit``: failed
    windows in a row that roll back (default 1)."""

    interval_seconds: Duration = Field(default=10.0, alias="interval")
    min_requests: Annotated[int, Field(ge=1)] = Field(default=20, alias="minRequests")
    failure_limit: Annotated[int, Field(ge=1)] = Field(default=1, alias="failureLimit")
    checks: ChecksSpec = Field(default_factory=ChecksSpec)
    local_guard: LocalGuardSpec = Field(default_factory=LocalGuardSpec, alias="localGuard")


class CanarySpec(_Spec):
    """A validated Canary spec, defaults applied. ``steps``: 1–32 steps, setWeights
    non-decreasing; :data:`DEFAULT_STEPS` when omitted or empty."""

    target_ref: TargetRef = Field(alias="targetRef")
    candidate: CandidateSpec
    steps: Annotated[tuple[Step, ...], Field(max_length=32)] = DEFAULT_STEPS
    analysis: AnalysisSpec = Field(default_factory=AnalysisSpec)

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
