"""The ModelDeployment resource: its status models, printer columns and identity; its spec is
:class:`mlx_fleet_operator.spec.DeploymentSpec`.

Pure: pydantic and the operator's spec module.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from ..spec import DeploymentSpec
from .conditions import CONDITIONS, Condition, Status
from .markers import Int32, Int64, Keywords
from .resource import PrinterColumn, Resource

__all__ = ["MODEL_DEPLOYMENT", "ModelDeploymentStatus", "NodeStatus", "DownloadStatus",
           "ModelDeploymentCondition", "RouterStatus"]

_NonNegative = Annotated[int, Field(ge=0)]


class DownloadStatus(Status):
    bytes_done: _NonNegative | None = Field(default=None, alias="bytesDone",
                                            description="Bytes received so far.")
    bytes_total: _NonNegative | None = Field(default=None, alias="bytesTotal",
                                             description="Bytes to receive (0 while unknown).")
    bytes_per_second: _NonNegative | None = Field(default=None, alias="bytesPerSecond",
                                                  description="Recent download rate.")
    eta_seconds: _NonNegative | None = Field(
        default=None, alias="etaSeconds", description="Seconds left at that rate (absent while unknown).")
    text: Annotated[str, Field(max_length=256)] | None = Field(
        default=None, description="The same in one line, for people.")


class NodeStatus(Status):
    """State of one revision's replica on one Mac."""

    name: str = Field(description="Name of the Mac (node record name).")
    revision: str = Field(default="", description=(
        "The model revision this replica serves (empty when not known; the default keeps it a "
        "usable list-map key)."))
    role: Literal["Stable", "Candidate", "Previous"] | None = Field(default=None, description=(
        "Which traffic the replica takes. Stable: spec.model.revision, the deployment's traffic "
        "once Ready. Candidate: a Canary's candidate revision, the share of traffic the Canary "
        "gives it. Previous: the revision a rolling update is replacing, serving until the Stable "
        "revision is Ready on that Mac."))
    state: Literal["Pending", "Prefetching", "Loading", "Ready", "Unloaded", "Failed"] | None = Field(
        default=None, description="Lifecycle state of the replica on this Mac.")
    reason: str | None = Field(default=None,
                               description="Machine-readable CamelCase reason for the state.")
    message: str | None = Field(default=None, description="Human-readable details about the state.")
    endpoint: str | None = Field(
        default=None, description="Base URL of the agent's OpenAI-compatible API on this Mac.")
    download: DownloadStatus | None = Field(default=None, description=(
        "The model download under way while the state is Prefetching (from the agent's report, "
        "refreshed at a bounded rate)."))
    digest: Annotated[str, Field(max_length=128)] | None = Field(default=None, description=(
        "Content address of the files this replica loaded, from its agent: sha256:<hex> for an "
        "https:// mirror (over its files' sorted paths and sha256), hf-commit:<commit> for an "
        "hf:// source; absent for a local directory or before the files are fetched. Replicas "
        "of one revision with different digests hold different bytes (condition "
        "ReplicasConsistent)."))


class RouterStatus(Status):
    """Where a client sends requests for this deployment through the fleet router."""

    url: str = Field(description=(
        "Base URL of the fleet router's OpenAI-compatible API (the operator's --router-url), "
        "e.g. http://mlx-fleet-router.mlx-fleet:8080; requests go to <url>/v1/..."))
    model: str = Field(description=(
        'The model id to pass as "model": spec.model.servedModelName, else metadata.name.'))


class ModelDeploymentCondition(Condition):
    """One aspect of the ModelDeployment's state (like metav1.Condition)."""

    type: Literal["Ready", "Progressing", "Degraded", "Scheduled", "ServedNameConflict",
                  "SourceAllowed", "ReplicasConsistent"] = Field(
        description=(
            "Condition type. ServedNameConflict is True while another ModelDeployment in the "
            "operator's scope claims the same served model name: the fleet router refuses the "
            "name for both until one changes spec.model.servedModelName or is deleted. "
            "SourceAllowed is False (reason SourceRefused) while the fleet's source policy "
            "refuses spec.model.source: nothing is placed for that spec. "
            "ReplicasConsistent is False (DigestMismatch) while replicas of one revision report "
            "different content digests (status.nodes[].digest): they hold different bytes."))


class ModelDeploymentStatus(Status):
    observed_generation: Int64 | None = Field(
        default=None, alias="observedGeneration",
        description="The metadata.generation this status was computed from.")
    replicas: Int32 | None = Field(default=None, description=(
        "Observed replicas: how many are placed on a Mac (have an assignment), in any state. "
        "The desired count is spec.replicas; readyReplicas of these are serving."))
    ready_replicas: Int32 | None = Field(default=None, alias="readyReplicas",
                                         description="Replicas that are loaded and serving.")
    updated_replicas: Int32 | None = Field(default=None, alias="updatedReplicas", description=(
        "Ready replicas that serve spec.model.revision (a rollout is complete when this equals "
        "spec.replicas and no replica of an older revision is left)."))
    nodes: Annotated[tuple[NodeStatus, ...], Keywords(**{
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name", "revision"]})] | None = Field(
        default=None, description=(
            "Per-Mac state of each assigned replica, one entry per (Mac, revision): during a "
            "rollout or a Canary a Mac may host two revisions of the deployment at once."))
    downloads: Annotated[str, Field(max_length=4096)] | None = Field(default=None, description=(
        'The downloads under way, one "<mac>: <progress>" per Mac that is prefetching, separated '
        'by "; " (printed by kubectl get -o wide).'))
    endpoints: tuple[Annotated[str, Keywords(
        description="Base URL of one agent's OpenAI-compatible API, e.g. http://mac-1:8000.")], ...] | None = Field(
        default=None, description="Base URLs of the agents serving this model with state Ready.")
    router: RouterStatus | None = Field(default=None, description=(
        "The URL and model id a client should use: the fleet router's, absent when the "
        "operator runs without a router (--router-url)."))
    conditions: Annotated[tuple[ModelDeploymentCondition, ...], CONDITIONS] | None = Field(
        default=None, description="Latest observations of the ModelDeployment's state.")


MODEL_DEPLOYMENT = Resource(
    kind="ModelDeployment",
    plural="modeldeployments",
    short_names=("md",),
    comment=("ModelDeployment v1alpha1: what to serve on the Mac fleet, how many replicas, with "
             "how much unified memory, where, and with which lifecycle policy."),
    doc=("ModelDeployment declares an LLM to serve with MLX on the Apple-Silicon Mac fleet: the "
         "model and its revision, the number of replicas, the unified memory each replica needs, "
         "placement constraints, serving limits and the lifecycle policy. The operator assigns "
         "replicas to Macs through etcd; the node agents load and serve them."),
    spec=DeploymentSpec,
    spec_doc="Desired state of the ModelDeployment.",
    status=ModelDeploymentStatus,
    status_doc="Observed state of the ModelDeployment, written by the operator.",
    columns=(
        PrinterColumn("Model", "string", "Where the model weights come from (spec.model.source).",
                      ".spec.model.source"),
        PrinterColumn("Revision", "string", "The model revision being served (spec.model.revision).",
                      ".spec.model.revision"),
        PrinterColumn("Ready", "integer",
                      "Replicas that are loaded and serving (status.readyReplicas).",
                      ".status.readyReplicas"),
        PrinterColumn("Desired", "integer", "Replicas asked for (spec.replicas).", ".spec.replicas"),
        PrinterColumn("Status", "string", "Status of the Ready condition (True, False or Unknown).",
                      '.status.conditions[?(@.type=="Ready")].status'),
        PrinterColumn("Served", "string",
                      "The model id clients send to the fleet router (status.router.model).",
                      ".status.router.model"),
        PrinterColumn("Router", "string",
                      "The fleet router's base URL for this model (status.router.url).",
                      ".status.router.url", priority=1),
        PrinterColumn("Downloads", "string", "Downloads under way per Mac (status.downloads).",
                      ".status.downloads", priority=1),
        PrinterColumn("Age", "date", "Time since the ModelDeployment was created.",
                      ".metadata.creationTimestamp"),
    ),
)
