"""The operator's admission of model sources (issue 19, finding 2) on plain data: the
refusal naming the field, and the ``SourceAllowed`` condition, the other conditions and the
Warning event that :func:`~mlx_fleet_operator.status.compute_status` derives from it."""

from __future__ import annotations

from mlx_fleet.source_policy import DEFAULT_POLICY, DEV_POLICY, SourcePolicy
from mlx_fleet_operator.admission import CANDIDATE_SOURCE_FIELD, source_refusal
from mlx_fleet_operator.status import StatusInput, compute_status


TYPES = ("Ready", "Progressing", "Degraded", "Scheduled", "ServedNameConflict", "SourceAllowed")


def conditions(status: dict) -> dict[str, tuple[str, str]]:
    """The conditions this test is about (others, about other things, may follow)."""
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]
            if c["type"] in TYPES}


def test_source_refusal_names_the_field_and_the_rule() -> None:
    assert source_refusal(DEFAULT_POLICY, "hf://mlx-community/Qwen3-0.6B-4bit") is None
    assert source_refusal(DEFAULT_POLICY, "https://models.example.com/qwen/") is None
    assert source_refusal(DEFAULT_POLICY, None) is None  # a Canary using the target's source
    got = source_refusal(DEFAULT_POLICY, "/models/qwen")
    assert got == ("spec.model.source: refused by the source policy: file:// sources are "
                   "allowed only under fileRoots, and none are configured")
    got = source_refusal(DEFAULT_POLICY, "https://127.0.0.5:8443/m/", CANDIDATE_SOURCE_FIELD)
    assert got is not None and got.startswith("spec.candidate.source: refused by the source "
                                              "policy: ") and "allowPrivateNetworks" in got
    assert source_refusal(DEV_POLICY, "/models/qwen") is None
    only = SourcePolicy(https_hosts=("models.example.com",))
    assert "httpsHosts" in (source_refusal(only, "https://other.example/m/") or "")


def test_a_refused_source_holds_the_deployment_with_conditions_and_one_event() -> None:
    refused = source_refusal(DEFAULT_POLICY, "https://127.0.0.1:8443/m/")
    assert refused is not None
    status, events = compute_status(StatusInput(generation=2, replicas=1,
                                                source_refused=refused))
    assert conditions(status) == {
        "Ready": ("False", "SourceRefused"), "Progressing": ("False", "SourceRefused"),
        "Degraded": ("True", "SourceRefused"), "Scheduled": ("False", "SourceRefused"),
        "ServedNameConflict": ("False", "NoConflict"),
        "SourceAllowed": ("False", "SourceRefused")}
    [allowed] = [c for c in status["conditions"] if c["type"] == "SourceAllowed"]
    assert allowed["message"] == refused and allowed["observedGeneration"] == 2
    assert [(e.type, e.reason, e.message) for e in events] == [
        ("Warning", "SourceRefused", refused)]
    # the same refusal again: no second event; the source fixed: SourceAllowed True
    again, events = compute_status(StatusInput(generation=2, replicas=1,
                                               source_refused=refused), status)
    assert events == [] and again["conditions"] == status["conditions"]
    fixed, events = compute_status(StatusInput(generation=3, replicas=1), again)
    assert conditions(fixed)["SourceAllowed"] == ("True", "SourceAllowed")
    assert conditions(fixed)["Degraded"] == ("False", "AsExpected")
    # an invalid spec afterwards keeps the last verdict on the source
    invalid, _ = compute_status(StatusInput(generation=4, replicas=1, spec_error="bad"), fixed)
    assert conditions(invalid)["SourceAllowed"] == ("True", "SourceAllowed")
    assert conditions(invalid)["Ready"] == ("False", "InvalidSpec")
    first_invalid, _ = compute_status(StatusInput(generation=1, replicas=1, spec_error="bad"))
    assert conditions(first_invalid)["SourceAllowed"] == ("Unknown", "InvalidSpec")
