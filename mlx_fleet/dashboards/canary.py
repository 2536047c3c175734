"""The Canary dashboard: weight and phase over time, candidate vs stable for every check the
analysis judges (error rate, p95 latency and time to first token, decode tokens/s, memory,
crashes), the local guard, and promotions and rollbacks.

Candidate and stable are told apart by the assignment's ``role`` (Stable, Candidate, Previous),
joined from ``mlxfleet_operator_served_model_info`` onto the per-revision statistics.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dash

from .panels import (TOKENS_PER_SECOND, datasource_variable, deployment_variable,
                     namespace_variable, quantiles, state_panel, timeseries_panel)

UID = "mlx-fleet-canary"

_DEP = 'namespace=~"$namespace", deployment=~"$deployment"'
_CANARY = 'namespace=~"$namespace", target=~"$deployment"'
_REV = "namespace, deployment, revision"
#: Attach each revision's role (one per revision at a time) to a per-revision expression.
_ROLE = (f" * on ({_REV}) group_left (role) "
         f"max by ({_REV}, role) (mlxfleet_operator_served_model_info{{{_DEP}}})")
_LEGEND = "{{deployment}} {{role}} {{revision}}"
#: The phase metrics have no ``target`` label: keep the Canaries whose weight series (which has
#: it) targets a selected deployment.
_OF_TARGET = (f" and on (namespace, name) "
              f"mlxfleet_operator_canary_weight{{{_CANARY}}}")


def _per_revision(expr: str) -> str:
    """``expr`` (one series per namespace/deployment/revision) labelled with the role."""
    return f"({expr}){_ROLE}"


def _rate(metric: str) -> str:
    return f"sum by ({_REV}) (rate({metric}{{{_DEP}}}[$__rate_interval]))"


def _quantile(metric: str, q: float) -> str:
    return quantiles(metric, _REV, _DEP, qs=(q,))[0][0]


def build() -> dash.Dashboard:
    requests = _rate("mlxfleet_operator_revision_requests_total")
    errors = _rate("mlxfleet_operator_revision_errors_total")
    return (
        dash.Dashboard("mlx-fleet / Canary").uid(UID).tags(["mlx-fleet"]).refresh("10s")
        .time("now-1h", "now").timezone("browser")
        .description("Canaries of the selected ModelDeployments: weight, phase and the "
                     "candidate vs stable revision on every analysed check.")
        .with_variable(datasource_variable()).with_variable(namespace_variable())
        .with_variable(deployment_variable())
        .with_row(dash.Row("Progress"))
        .with_panel(timeseries_panel(
            "Candidate weight", "percent",
            [(f"mlxfleet_operator_canary_weight{{{_CANARY}}}", "{{name}} → {{target}}")],
            description="Percent of the sessions sent to the candidate revision."))
        .with_panel(timeseries_panel(
            "Phases entered (promotions, rollbacks)", "none",
            [(f"sum by (namespace, name, phase) (mlxfleet_operator_canary_transitions_total"
              f'{{namespace=~"$namespace"}}{_OF_TARGET})', "{{name}} {{phase}}")],
            description="Times each phase was entered since the operator started (a step up "
                        "is a transition): Succeeded = promoted, RolledBack = rolled back by the "
                        "analysis, Aborted = by hand. The reason of each is in the Canary's "
                        "events and status (kubectl describe canary)."))
        .with_panel(state_panel(
            "Phase", [(f'(mlxfleet_operator_canary_phase{{namespace=~"$namespace"}} == 1)'
                       f"{_OF_TARGET}", "{{name}} {{phase}}")],
            description="The Canary's current phase over time."))
        .with_row(dash.Row("Candidate vs stable"))
        .with_panel(timeseries_panel(
            "Requests/s", "reqps", [(_per_revision(requests), _LEGEND)]))
        .with_panel(timeseries_panel(
            "Error ratio", "percentunit", [(_per_revision(f"{errors} / {requests}"), _LEGEND)],
            description="Server-side failures / requests (check errorRate)."))
        .with_panel(timeseries_panel(
            "p95 latency", "s",
            [(_per_revision(_quantile("mlxfleet_operator_revision_request_duration_seconds",
                                      0.95)), _LEGEND)],
            description="Check latencyP95."))
        .with_panel(timeseries_panel(
            "p95 time to first token", "s",
            [(_per_revision(_quantile("mlxfleet_operator_revision_time_to_first_token_seconds",
                                      0.95)), _LEGEND)],
            description="Check ttftP95."))
        .with_panel(timeseries_panel(
            "Median decode tokens/s per sequence", TOKENS_PER_SECOND,
            [(_per_revision(_quantile("mlxfleet_operator_revision_decode_tokens_per_second",
                                      0.5)), _LEGEND)],
            description="Check tokensPerSecond."))
        .with_panel(timeseries_panel(
            "Resident memory", "bytes",
            [(f"sum by ({_REV}, role) (mlxfleet_operator_assignment_resident_bytes{{{_DEP}}})",
              _LEGEND)],
            description="Unified memory of each revision's models, summed over Macs (check "
                        "memoryGrowth)."))
        .with_panel(timeseries_panel(
            "Crashes over the time range", "none",
            [(_per_revision(f"sum by ({_REV}) (increase(mlxfleet_operator_revision_crashes_"
                            f"total{{{_DEP}}}[$__range]))"), _LEGEND)],
            description="Serving-core failures that hit the revision (check crashes)."))
        .with_panel(timeseries_panel(
            "Macs with the local guard tripped", "none",
            [(f"mlxfleet_operator_canary_guard_tripped_nodes{{{_DEP}}}", "{{deployment}}")],
            description="Macs whose local guard sent all the deployment's traffic to the "
                        "stable revision."))
    )
