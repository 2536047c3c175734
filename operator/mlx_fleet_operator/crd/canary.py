"""The Canary resource: its status models, printer columns and identity; its spec is
:class:`mlx_fleet_operator.canary_spec.CanarySpec`.

Pure: pydantic and the operator's spec modules.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from ..canary_spec import CanarySpec
from .conditions import CONDITIONS, Condition, Status
from .markers import Int32, Int64, Keywords
from .resource import PrinterColumn, Resource

__all__ = ["CANARY", "CanaryStatus", "AnalysisStatus", "CheckStatus", "CanaryCondition"]

Verdict = Literal["Pass", "Fail", "Inconclusive"]
_Nullable = Annotated[float, Keywords(nullable=True)]


class CheckStatus(Status):
    """The result of one check in the window."""

    name: str = Field(description=(
        "The check (errorRate, latencyP95, ttftP95, tokensPerSecond, memoryGrowth, crashRate)."))
    verdict: Verdict | None = Field(
        default=None, description="Pass, Fail or Inconclusive (too little data for this check).")
    stable: _Nullable | None = Field(default=None, description=(
        "The stable revision's value in the window (null or absent when unknown)."))
    candidate: _Nullable | None = Field(default=None, description=(
        "The candidate's value in the window (null or absent when unknown)."))
    threshold: _Nullable | None = Field(default=None, description=(
        "The limit the candidate's value was held to (null or absent when none applied)."))
    message: str | None = Field(default=None,
                                description="Human-readable explanation of the verdict.")


class AnalysisStatus(Status):
    verdict: Verdict | None = Field(default=None, description=(
        "Pass: every enabled check passed. Fail: at least one failed. Inconclusive: too few "
        "requests (analysis.minRequests) or no data."))
    window_end: str | None = Field(default=None, alias="windowEnd",
                                   description="When the window ended (RFC 3339).")
    message: str | None = Field(default=None, description=(
        "The failed (or inconclusive) checks' messages, or a one-line summary when the window "
        "passed."))
    stable_requests: Int64 | None = Field(
        default=None, alias="stableRequests",
        description="Requests the stable revision served in the window.")
    candidate_requests: Int64 | None = Field(
        default=None, alias="candidateRequests",
        description="Requests the candidate served in the window.")
    checks: Annotated[tuple[CheckStatus, ...], Keywords(**{
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})] | None = Field(
        default=None, description="The result of each check that ran, one per name.")


class CanaryCondition(Condition):
    """One aspect of the Canary's state (like metav1.Condition)."""

    type: Literal["Progressing", "Succeeded", "Degraded"] = Field(description=(
        "Condition type. Progressing: the release is running. Succeeded: the candidate was "
        "promoted. Degraded: the release failed, was rolled back, was aborted or its spec is "
        "invalid (reason InvalidSpec)."))


class CanaryStatus(Status):
    phase: Literal["Pending", "Progressing", "Paused", "Promoting", "Succeeded", "RolledBack",
                   "Aborted", "Failed"] | None = Field(default=None, description=(
        "Pending: accepted, not started yet. Progressing: running the steps. Paused: holding at "
        "a pause step. Promoting: the target's spec.model.revision is being set to the "
        "candidate's and rolled out. Succeeded: promoted. RolledBack: an analysis or a local "
        "guard failed; weight 0, candidate unloaded. Aborted: stopped by the abort annotation; "
        "weight 0, candidate unloaded. Failed: the Canary cannot run (see message and the "
        "Degraded condition), e.g. an invalid cross-object spec."))
    observed_generation: Int64 | None = Field(
        default=None, alias="observedGeneration",
        description="The metadata.generation this status was computed from.")
    stable_revision: str | None = Field(
        default=None, alias="stableRevision",
        description="The target's revision the candidate is compared with.")
    candidate_revision: str | None = Field(
        default=None, alias="candidateRevision",
        description="The revision being released (spec.candidate.revision when started).")
    current_step_index: Int32 | None = Field(
        default=None, alias="currentStepIndex",
        description="Index in spec.steps of the step running now.")
    current_weight: Int32 | None = Field(
        default=None, alias="currentWeight",
        description="Percent of the traffic the candidate receives now.")
    step_started: str | None = Field(default=None, alias="stepStarted",
                                     description="When the current step started (RFC 3339).")
    started: str | None = Field(default=None, description="When the release started (RFC 3339).")
    failed_windows: Int32 | None = Field(
        default=None, alias="failedWindows",
        description="Failed analysis windows so far (rolled back at analysis.failureLimit).")
    message: str | None = Field(default=None,
                                description="Human-readable summary of the current phase.")
    last_promote_token: str | None = Field(default=None, alias="lastPromoteToken", description=(
        "The last mlx-fleet.io/promote or mlx-fleet.io/promote-full annotation value acted on; a "
        "new value is a new request."))
    last_abort_token: str | None = Field(
        default=None, alias="lastAbortToken",
        description="The last mlx-fleet.io/abort annotation value acted on.")
    last_promote_full_token: str | None = Field(
        default=None, alias="lastPromoteFullToken",
        description="The last mlx-fleet.io/promote-full annotation value acted on.")
    reason: str | None = Field(default=None, description=(
        "CamelCase reason of the last transition (e.g. StableUnhealthy while a rollback is "
        "held)."))
    memory_baseline_bytes: Int64 | None = Field(default=None, alias="memoryBaselineBytes", description=(
        "The candidate's largest per-node resident bytes when the canary started progressing "
        "(the memory-growth check's baseline)."))
    last_analysis: AnalysisStatus | None = Field(
        default=None, alias="lastAnalysis", description="The verdict of the last analysis window.")
    conditions: Annotated[tuple[CanaryCondition, ...], CONDITIONS] | None = Field(
        default=None, description="Latest observations of the Canary's state.")


CANARY = Resource(
    kind="Canary",
    plural="canaries",
    short_names=("can",),
    comment=("Canary v1alpha1: a progressive release of a new revision of one ModelDeployment. "
             "The candidate revision is loaded next to the stable one, takes a growing share of "
             "the traffic step by step, is compared with the stable revision on live metrics, "
             "and is promoted or rolled back."),
    doc=("Canary releases a candidate revision of one ModelDeployment progressively: the "
         "candidate is loaded next to the stable revision, receives the traffic share of each "
         "step in turn, and is compared with the stable revision on live metrics every analysis "
         "interval. A failing analysis rolls it back (weight 0, candidate unloaded); passing "
         "every step promotes it (the ModelDeployment's spec.model.revision becomes the "
         "candidate's)."),
    spec=CanarySpec,
    spec_doc="Desired release of the Canary.",
    status=CanaryStatus,
    status_doc="Observed state of the Canary, written by the operator.",
    columns=(
        PrinterColumn("Target", "string", "The ModelDeployment being released (spec.targetRef.name).",
                      ".spec.targetRef.name"),
        PrinterColumn("Candidate", "string",
                      "The revision being released (spec.candidate.revision).",
                      ".spec.candidate.revision"),
        PrinterColumn("Weight", "integer",
                      "Percent of the traffic the candidate receives now (status.currentWeight).",
                      ".status.currentWeight"),
        PrinterColumn("Phase", "string", "Where the release stands (status.phase).", ".status.phase"),
        PrinterColumn("Age", "date", "Time since the Canary was created.",
                      ".metadata.creationTimestamp"),
    ),
)
