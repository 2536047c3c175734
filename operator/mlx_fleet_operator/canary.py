"""The Canary step machine: ``step(spec, state, observation, now) -> Decision``, a pure function.

The operator calls :func:`step` on every tick of a Canary (a timer at ``requeue_after``, and
whenever the target, the candidate's reports or the annotations change), writes
``decision.state.to_status()`` into the Canary's status, ``decision.weight`` into the
:class:`~mlx_fleet.contract.TrafficSplit` (and removes the split once ``keep_candidate`` is
False), emits ``decision.events`` and, when ``decision.promote_revision`` is set, patches the
ModelDeployment's ``spec.model.revision`` *before* writing the status (a lost status write is
then re-derived: the target already names the candidate).

Phases::

    Pending ──candidate Ready──▶ Progressing (setWeight step) ⇄ Paused (pause step)
        ──last step passed, or promote-full──▶ Promoting ──target Ready at candidate──▶ Succeeded
    any running phase ──▶ RolledBack (failureLimit failed windows in a row, or the agents'
        local guard tripped) | Aborted (abort token) | Failed (candidate failed, target gone)

Terminal phases (Succeeded, RolledBack, Aborted, Failed) stay so until the spec names another
candidate revision, which restarts the canary from Pending (as does the first tick of a new
Canary). Editing the ModelDeployment's revision to a third one during a canary restarts from
step one with it as the stable revision; editing it to the candidate is a promotion.

A setWeight step applies its weight and then needs one passing analysis window, evaluated at
least one analysis interval after the step began (issue #5: "one analysis interval between
steps"); Inconclusive windows hold. A rollback never sends traffic back onto an unhealthy
stable revision: the machine holds the weight in Paused (reason ``StableUnhealthy``) and rolls
back once the stable revision is healthy again (or a promote/abort token decides).

Tokens (the promote, promote-full and abort annotations' values) are edge-triggered: a value
acts on the tick it first differs from the one recorded in the state, and is recorded on every
tick, so a value already set when a canary (re)starts does nothing. A plain promote in Pending
does nothing (there is no step to end yet).

Pure: imports only the standard library and this package's pure modules; time is ``now``.
"""

from __future__ import annotations

import datetime
import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from .analysis import AnalysisResult, Verdict
from .canary_spec import CanarySpec


class Phase(str, enum.Enum):
    PENDING = "Pending"
    PROGRESSING = "Progressing"
    PAUSED = "Paused"
    PROMOTING = "Promoting"
    SUCCEEDED = "Succeeded"
    ROLLED_BACK = "RolledBack"
    ABORTED = "Aborted"
    FAILED = "Failed"


#: Phases that stay put until the spec names a new candidate revision.
TERMINAL = frozenset({Phase.SUCCEEDED, Phase.ROLLED_BACK, Phase.ABORTED, Phase.FAILED})
#: The reason of a Paused phase that holds a rollback because the stable revision is unhealthy.
STABLE_UNHEALTHY = "StableUnhealthy"
#: Requeue bound (seconds) while waiting for readiness (Pending, Promoting).
WAIT_REQUEUE_SECONDS = 5.0


def _camel(name: str) -> str:
    return re.sub(r"_([a-z])", lambda m: m[1].upper(), name)


#: State fields whose status name is not their camelCase name (the CRD's printer columns read
#: ``currentWeight``).
_STATUS_NAMES = {"step_index": "currentStepIndex", "weight": "currentWeight"}
_TIMES = frozenset({"started", "step_started"})


def _rfc3339(t: float) -> str:
    if not t:
        return ""
    stamp = datetime.datetime.fromtimestamp(t, datetime.timezone.utc)
    return stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _parse_rfc3339(v: Any) -> float:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if not v:
        return 0.0
    return datetime.datetime.fromisoformat(str(v).replace("Z", "+00:00")).timestamp()


@dataclass(frozen=True)
class CanaryState:
    """The machine's state; round-trips through the Canary's ``status`` (camelCase keys).

    ``step_index``: index into ``spec.steps``; ``weight``: candidate percent now;
    ``step_started``: unix seconds the current step (or Pending) began; ``started``: unix
    seconds the first step began (0 while Pending; the canary's age for memory growth);
    ``failed_windows``: failed analysis windows in a row; ``last_analysis``:
    :meth:`AnalysisResult.to_dict` of the last window; ``reason``: CamelCase reason of the last
    transition (``Paused`` + ``StableUnhealthy`` is a held rollback); ``last_*_token``: the
    annotation values already acted on; ``memory_baseline_bytes``: the candidate's resident
    bytes when the canary started progressing (0: not seen yet), for the memory-growth check.
    """

    phase: Phase = Phase.PENDING
    step_index: int = 0
    weight: int = 0
    step_started: float = 0.0
    stable_revision: str = ""
    candidate_revision: str = ""
    failed_windows: int = 0
    last_analysis: dict[str, Any] | None = None
    message: str = ""
    reason: str = ""
    last_promote_token: str = ""
    last_promote_full_token: str = ""
    last_abort_token: str = ""
    started: float = 0.0
    memory_baseline_bytes: int = 0

    def to_status(self) -> dict[str, Any]:
        """The Canary ``status`` fields (camelCase, JSON-ready, the CRD's names and types):
        ``step_index``/``weight`` are ``currentStepIndex``/``currentWeight``; the times
        ``started``/``step_started`` are RFC 3339 strings with milliseconds (``""`` for 0)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Phase):
                v = v.value
            elif f.name in _TIMES:
                v = _rfc3339(v)
            out[_STATUS_NAMES.get(f.name, _camel(f.name))] = v
        return out

    @classmethod
    def from_status(cls, status: Mapping[str, Any] | None) -> CanaryState:
        """Parse :meth:`to_status`'s output; missing, null or malformed fields take their
        defaults (an empty status is a canary that has not started)."""
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            value = (status or {}).get(_STATUS_NAMES.get(f.name, _camel(f.name)))
            convert = (dict if f.name == "last_analysis" else _parse_rfc3339
                       if f.name in _TIMES else type(f.default))
            if value is not None:
                try:
                    kwargs[f.name] = convert(value)
                except (TypeError, ValueError):
                    pass
        return cls(**kwargs)


@dataclass(frozen=True)
class Observation:
    """What the operator sees at this tick.

    ``target_revision``: the target ModelDeployment's ``spec.model.revision``;
    ``candidate_ready``: every candidate replica Ready; ``candidate_failed``: why the candidate
    failed (None: it hasn't); ``stable_ready``: the stable revision has ≥ 1 Ready replica and no
    failure; ``guard_tripped``: the agents' local guard reason (None: not tripped);
    ``analysis``: a window evaluated at this tick (None: no new window); ``*_token``: the
    promote / promote-full / abort annotation values ("" when unset); ``rollout_complete``: the
    target is Ready at the candidate revision; ``candidate_memory_bytes``: the candidate's
    largest per-node resident bytes now (0: unknown)."""

    target_revision: str
    target_exists: bool = True
    candidate_ready: bool = False
    candidate_failed: str | None = None
    stable_ready: bool = True
    guard_tripped: str | None = None
    analysis: AnalysisResult | None = None
    promote_token: str = ""
    promote_full_token: str = ""
    abort_token: str = ""
    rollout_complete: bool = False
    candidate_memory_bytes: int = 0


@dataclass(frozen=True)
class Decision:
    """What to do after a tick. ``weight``: candidate percent for the TrafficSplit (0 once
    RolledBack/Aborted/Failed); ``events``: ``(type, reason, message)`` per transition, type
    ``Normal`` or ``Warning``; ``promote_revision``: patch the target's ``spec.model.revision``
    to this (set on one tick only); ``keep_candidate``: False once terminal (unload the
    candidate, remove the split); ``requeue_after``: seconds until the next tick is needed
    (None: terminal, none needed)."""

    state: CanaryState
    weight: int
    events: list[tuple[str, str, str]] = field(default_factory=list)
    promote_revision: str | None = None
    keep_candidate: bool = True
    requeue_after: float | None = None


def step(spec: CanarySpec, state: CanaryState, obs: Observation, now: float) -> Decision:
    """Advance the canary by one tick (see the module docstring for the rules)."""
    tick = _Tick(spec, state, obs, now)
    tick.run()
    return tick.decision()


class _Tick:
    def __init__(self, spec: CanarySpec, state: CanaryState, obs: Observation, now: float):
        self.spec, self.s, self.obs, self.now = spec, state, obs, now
        self.events: list[tuple[str, str, str]] = []
        self.promote: str | None = None

    # -- helpers -------------------------------------------------------------------------------
    def go(self, phase: Phase, reason: str, message: str, warning: bool = False,
           **changes: Any) -> None:
        """A transition: new phase, reason and message, one event."""
        self.s = replace(self.s, phase=phase, reason=reason, message=message, **changes)
        self.events.append(("Warning" if warning else "Normal", reason, message))

    def is_new(self, token: str, last: str) -> bool:
        return bool(token) and token != last

    def restart(self, reason: str, message: str) -> None:
        self.go(Phase.PENDING, reason, message, step_index=0, weight=0, step_started=self.now,
                started=0.0, stable_revision=self.obs.target_revision,
                candidate_revision=self.spec.candidate.revision, failed_windows=0,
                last_analysis=None, memory_baseline_bytes=0,
                last_promote_token=self.obs.promote_token,
                last_promote_full_token=self.obs.promote_full_token,
                last_abort_token=self.obs.abort_token)

    def enter(self, i: int) -> None:
        """Begin step ``i`` (or Promoting after the last one)."""
        steps, n = self.spec.steps, len(self.spec.steps)
        if i >= n:
            self.promoting(f"all {n} steps passed; promoting {self.s.candidate_revision}")
            return
        common = dict(step_index=i, step_started=self.now, failed_windows=0)
        w = steps[i].set_weight
        if w is not None:
            self.go(Phase.PROGRESSING, "StepStarted",
                    f"step {i + 1}/{n}: candidate weight {self.s.weight}% → {w}%", weight=w,
                    **common)
        else:
            d = steps[i].pause.duration_seconds  # type: ignore[union-attr]
            self.go(Phase.PAUSED, "Paused", f"step {i + 1}/{n}: paused at weight "
                    f"{self.s.weight}% " + (f"for {d:g}s" if d else "until promoted"), **common)

    def promoting(self, message: str) -> None:
        cand = self.s.candidate_revision
        if self.obs.target_revision != cand:
            self.promote = cand
        self.go(Phase.PROMOTING, "Promoting", message, failed_windows=0,
                weight=100 if self.obs.candidate_ready else self.s.weight)

    def rollback_reason(self) -> str | None:
        if self.obs.guard_tripped is not None:
            return f"local guard tripped: {self.obs.guard_tripped}"
        if self.s.failed_windows >= self.spec.analysis.failure_limit:
            last = (self.s.last_analysis or {}).get("message", "")
            return (f"{self.s.failed_windows} failed analysis window(s) in a row "
                    f"(failureLimit {self.spec.analysis.failure_limit}): {last}")
        return None

    # -- the rules -----------------------------------------------------------------------------
    def run(self) -> None:
        s, obs, cand = self.s, self.obs, self.spec.candidate.revision
        if s.candidate_revision != cand:
            if s.candidate_revision:
                self.restart("Restarted", f"candidate revision changed from "
                             f"{s.candidate_revision} to {cand}: restarting from step one")
            else:
                self.restart("Started", f"canary of {cand} against stable "
                             f"{obs.target_revision or '?'} started; waiting for the candidate")
        elif s.phase in TERMINAL:
            return
        if not obs.target_exists:
            self.go(Phase.FAILED, "TargetNotFound", "target ModelDeployment "
                    f"{self.spec.target_ref.name} not found", warning=True, weight=0)
            return
        if self.is_new(obs.abort_token, self.s.last_abort_token):
            self.go(Phase.ABORTED, "Aborted", f"aborted by annotation; all traffic to stable "
                    f"{self.s.stable_revision}", warning=True, weight=0)
            return
        if obs.target_revision not in (self.s.stable_revision, cand):
            self.restart("Restarted", f"ModelDeployment revision changed from "
                         f"{self.s.stable_revision} to {obs.target_revision} during the canary: "
                         f"restarting from step one with it as stable")
        if obs.candidate_failed is not None:
            self.go(Phase.FAILED, "CandidateFailed", f"candidate {cand} failed: "
                    f"{obs.candidate_failed}", warning=True, weight=0)
            return
        if self.s.phase is not Phase.PROMOTING:
            if self.is_new(obs.promote_full_token, self.s.last_promote_full_token):
                self.promoting(f"full promotion requested; promoting {cand}")
            elif obs.target_revision == cand:
                self.promoting(f"the ModelDeployment already names {cand}; promoting")
        if self.s.phase is Phase.PROMOTING:
            self.run_promoting()
        elif self.s.phase is Phase.PENDING:
            if obs.candidate_ready:
                self.s = replace(self.s, started=self.now)
                self.enter(0)
        else:
            self.run_steps()

    def run_promoting(self) -> None:
        if self.obs.rollout_complete and self.obs.target_revision == self.s.candidate_revision:
            self.go(Phase.SUCCEEDED, "Succeeded", f"{self.s.candidate_revision} is the "
                    f"ModelDeployment's revision and Ready")
        elif self.obs.candidate_ready and self.s.weight < 100:
            self.go(Phase.PROMOTING, "WeightChanged", f"candidate weight {self.s.weight}% → "
                    f"100% while promoting", weight=100)

    def run_steps(self) -> None:
        s, obs, spec = self.s, self.obs, self.spec
        held = s.phase is Phase.PAUSED and s.reason == STABLE_UNHEALTHY
        a = obs.analysis
        if a is not None and not held:
            self.s = s = replace(s, last_analysis=a.to_dict())
            if a.verdict is Verdict.PASS:
                self.s = s = replace(s, failed_windows=0)
            elif a.verdict is Verdict.FAIL:
                self.s = s = replace(s, failed_windows=s.failed_windows + 1)
                self.events.append(("Warning", "AnalysisFailed", f"window failed "
                                    f"({s.failed_windows}/{spec.analysis.failure_limit}): "
                                    f"{a.message}"))
                self.s = s = replace(s, message=self.events[-1][2])
        if self.is_new(obs.promote_token, s.last_promote_token):
            if s.phase is Phase.PAUSED and s.reason != STABLE_UNHEALTHY:
                self.go(Phase.PAUSED, "Resumed", f"step {s.step_index + 1}: promoted by "
                        f"annotation")
            self.enter(s.step_index + 1)
            return
        why = self.rollback_reason()
        if why is not None:
            if obs.stable_ready:
                self.go(Phase.ROLLED_BACK, "RolledBack", f"rolled back to "
                        f"{s.stable_revision}: {why}", warning=True, weight=0)
            elif not held:
                self.go(Phase.PAUSED, STABLE_UNHEALTHY, f"not rolling back onto unhealthy "
                        f"stable {s.stable_revision}; holding candidate weight {s.weight}% "
                        f"({why})", warning=True)
            return
        if s.step_index >= len(spec.steps):  # the steps were shortened under a running canary
            self.enter(s.step_index)
            return
        current = spec.steps[s.step_index]
        if held:  # the reason to roll back went away (the guard cleared): redo this step
            self.go(Phase.PROGRESSING if current.pause is None else Phase.PAUSED, "Resumed",
                    f"step {s.step_index + 1}: resumed, no rollback pending",
                    step_started=self.now)
        elif current.set_weight is not None and current.set_weight != s.weight:  # step edited
            self.go(Phase.PROGRESSING, "WeightChanged", f"step {s.step_index + 1}: candidate "
                    f"weight {s.weight}% → {current.set_weight}%", weight=current.set_weight,
                    step_started=self.now)
        elif current.pause is None:
            if (a is not None and a.verdict is Verdict.PASS
                    and self.now - s.step_started >= spec.analysis.interval_seconds):
                self.enter(s.step_index + 1)
        elif (d := current.pause.duration_seconds) and self.now - s.step_started >= d:
            self.go(Phase.PAUSED, "Resumed", f"step {s.step_index + 1}: pause of {d:g}s over")
            self.enter(s.step_index + 1)

    # -- the result ----------------------------------------------------------------------------
    def decision(self) -> Decision:
        obs = self.obs
        s = replace(self.s, last_promote_token=obs.promote_token,
                    last_promote_full_token=obs.promote_full_token,
                    last_abort_token=obs.abort_token)
        if (s.phase in (Phase.PROGRESSING, Phase.PAUSED) and not s.memory_baseline_bytes
                and obs.candidate_memory_bytes > 0):
            s = replace(s, memory_baseline_bytes=obs.candidate_memory_bytes)
        interval = self.spec.analysis.interval_seconds
        requeue: float | None = interval
        if s.phase in TERMINAL:
            requeue = None
        elif s.phase in (Phase.PENDING, Phase.PROMOTING):
            requeue = min(WAIT_REQUEUE_SECONDS, interval)
        elif s.phase is Phase.PAUSED and s.reason != STABLE_UNHEALTHY:
            pause = self.spec.steps[s.step_index].pause
            if pause is not None and pause.duration_seconds:
                left = s.step_started + pause.duration_seconds - self.now
                requeue = max(0.0, min(interval, left))
        return Decision(state=s, weight=s.weight, events=self.events,
                        promote_revision=self.promote, keep_candidate=s.phase not in TERMINAL,
                        requeue_after=requeue)
