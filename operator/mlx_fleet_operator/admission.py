"""Admission of a model source by the fleet's source policy: a pure decision (no I/O).

The operator's ``--source-policy`` (:mod:`mlx_fleet.source_policy`, the record every agent
of the fleet is given too) judges the source a ModelDeployment or a Canary names before the
operator writes any assignment for it. A refused source is not placed: the ModelDeployment
keeps what was placed for its last admitted spec (like an invalid spec) and shows
``SourceAllowed=False`` with reason ``SourceRefused`` and a Warning event; a Canary fails
with reason ``SourceRefused``. The message names the field and the policy's rule
(``spec.model.source: refused by the source policy: …``), never what a connection would
answer: the operator connects to nothing to decide.
"""

from __future__ import annotations

from mlx_fleet.source_policy import SOURCE_REFUSED, SourcePolicy, check_source

__all__ = ["source_refusal", "SOURCE_REFUSED", "MODEL_SOURCE_FIELD", "CANDIDATE_SOURCE_FIELD"]

#: The ModelDeployment field a refusal names.
MODEL_SOURCE_FIELD = "spec.model.source"
#: The Canary field a refusal names.
CANDIDATE_SOURCE_FIELD = "spec.candidate.source"


def source_refusal(policy: SourcePolicy, source: str | None,
                   field: str = MODEL_SOURCE_FIELD) -> str | None:
    """``"<field>: refused by the source policy: <rule>"`` when ``policy`` refuses the
    source URI ``source``, else None (also for None: a Canary without its own source uses
    the target's, judged on the target)."""
    if source is None:
        return None
    refusal = check_source(policy, source)
    return None if refusal is None else f"{field}: {refusal.message}"
