"""The ``status.conditions`` entry both resources share (the shape of ``metav1.Condition``);
each resource subclasses :class:`Condition` with its own ``type`` enum and descriptions.

Pure: pydantic only.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from .markers import Int64, Keywords

__all__ = ["Status", "Condition", "CONDITIONS"]


class Status(BaseModel):
    """Base of the status models: the JSON shape the operator writes (aliases are the JSON
    names); used for the CRD schema."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)


class Condition(Status):
    """One aspect of the object's state (like metav1.Condition)."""

    type: str = Field(description="Condition type.")
    status: Literal["True", "False", "Unknown"] = Field(description="Status of the condition.")
    reason: Annotated[str, Field(min_length=1, max_length=1024)] = Field(
        description="Machine-readable CamelCase reason for the last transition.")
    message: Annotated[str, Field(max_length=32768)] = Field(
        description="Human-readable details about the last transition.")
    last_transition_time: Annotated[str, Keywords(format="date-time")] = Field(
        alias="lastTransitionTime", description="When the condition last changed status.")
    observed_generation: Annotated[Int64, Field(ge=0)] | None = Field(
        default=None, alias="observedGeneration",
        description="The metadata.generation the condition was computed from.")


#: Keywords of a ``conditions`` list: a list-map keyed by ``type``, as in Kubernetes' own types.
CONDITIONS = Keywords(**{"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})
