"""The Fleet dashboard: Macs by health, memory used vs budget per Mac, models loaded, requests/s,
decode tokens/s, TTFT and latency percentiles and errors, per ModelDeployment; and the fleet
router's requests, latency, upstream attempts and retries, circuit breakers, affinity and
rate limits.

Everything but the "responses by status code" panel and the Router row comes from the
operator's ``/metrics`` (the one scrape a cluster's Prometheus needs); that panel reads the
agents' own ``/metrics`` and shows data only where Prometheus also scrapes the Macs (with a
``node`` label per Mac, see docs/dashboards.md), the Router row the routers' ``/metrics``
(``mlxfleet_router_*``, router/mlx_fleet_router/metrics.py). The router labels requests by
served model name (``model``); the ``$namespace``/``$deployment`` selection reaches them through
the operator's ``mlxfleet_operator_served_model_info`` (deployment → model), so a name no
deployment serves (``unknown``) shows under "All" only through the per-tenant panel.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dash

from .panels import (TOKENS_PER_SECOND, datasource_variable, deployment_variable,
                     namespace_variable, node_variable, quantiles, stat_panel, state_panel,
                     table_panel, timeseries_panel)

UID = "mlx-fleet-fleet"

_NODE = 'node=~"$node"'
_DEP = 'namespace=~"$namespace", deployment=~"$deployment"'
_BY_DEP = "namespace, deployment"


def _rate(metric: str, selector: str = _DEP, by: str = _BY_DEP) -> str:
    return f"sum by ({by}) (rate({metric}{{{selector}}}[$__rate_interval]))"


#: The served model names of the selected ModelDeployments (the operator's info metric).
_SELECTED_MODELS = f"group by (model) (mlxfleet_operator_served_model_info{{{_DEP}}})"


def _router_rate(metric: str, by: str, selector: str = "") -> str:
    """Per-second rate of a router counter summed ``by`` labels that include ``model``, kept
    for the selected deployments' served names only."""
    return (f"sum by ({by}) (rate({metric}{{{selector}}}[$__rate_interval])) "
            f"and on (model) {_SELECTED_MODELS}")


def _router_quantiles(metric: str) -> list[tuple[str, str]]:
    """p50/p95/p99 of a router histogram labelled ``model``, for the selected served names."""
    return [(f"histogram_quantile({q}, sum by (le, model) "
             f"(rate({metric}_bucket[$__rate_interval])) and on (model) {_SELECTED_MODELS})",
             f"{{{{model}}}} p{round(q * 100)}") for q in (0.5, 0.95, 0.99)]


def build() -> dash.Dashboard:
    requests = _rate("mlxfleet_operator_revision_requests_total")
    errors = _rate("mlxfleet_operator_revision_errors_total")
    return (
        dash.Dashboard("mlx-fleet / Fleet").uid(UID).tags(["mlx-fleet"]).refresh("30s")
        .time("now-1h", "now").timezone("browser")
        .description("The Mac fleet and its ModelDeployments, from the mlx-fleet operator's "
                     "/metrics (docs/metrics.md).")
        .with_variable(datasource_variable()).with_variable(namespace_variable())
        .with_variable(deployment_variable()).with_variable(node_variable())
        .with_row(dash.Row("Macs"))
        .with_panel(stat_panel(
            "Macs by health", "none",
            [("mlxfleet_operator_nodes", "{{health}}")],
            description="Registered Macs (node records in etcd) by health.", width=8))
        .with_panel(stat_panel(
            "Models loaded", "none",
            [(f'sum(mlxfleet_operator_node_assignments{{state="Ready", {_NODE}}})', "loaded")],
            description="Assignments in state Ready on the selected Macs.", width=8))
        .with_panel(stat_panel(
            "Supervised tasks up", "none",
            [("sum(mlxfleet_operator_task_up)", "up"), ("count(mlxfleet_operator_task_up)",
                                                         "of")],
            description="The operator's etcd followers and assignment GC (1 each while "
                        "running).", width=8))
        .with_panel(timeseries_panel(
            "Memory used vs budget per Mac", "bytes",
            [(f"mlxfleet_operator_node_memory_total_bytes{{{_NODE}}} - "
              f"mlxfleet_operator_node_memory_available_bytes{{{_NODE}}}", "{{node}} used"),
             (f"mlxfleet_operator_node_memory_reserved_bytes{{{_NODE}}}", "{{node}} reserved"),
             (f"mlxfleet_operator_node_memory_budget_bytes{{{_NODE}}}", "{{node}} budget")],
            description="Used: total - available as the agent reports it. Reserved: the "
                        "memory of the assignments placed on the Mac (what placement counts). "
                        "Budget: total x the placement watermark."))
        .with_panel(timeseries_panel(
            "Models loaded per Mac", "none",
            [(f'mlxfleet_operator_node_assignments{{state="Ready", {_NODE}}}', "{{node}}")],
            description="Assignments in state Ready per Mac."))
        .with_row(dash.Row("ModelDeployments"))
        .with_panel(timeseries_panel(
            "Requests/s per ModelDeployment", "reqps",
            [(requests, "{{namespace}}/{{deployment}}")],
            description="Generation requests, summed over revisions and Macs (the agents' "
                        "statistics: every 15 s, or a canary's analysis interval)."))
        .with_panel(timeseries_panel(
            "Error ratio per ModelDeployment", "percentunit",
            [(f"{errors} / {requests}", "{{namespace}}/{{deployment}}")],
            description="Server-side failures (5xx, streams ended by an error) / requests."))
        .with_panel(timeseries_panel(
            "Time to first token", "s",
            quantiles("mlxfleet_operator_revision_time_to_first_token_seconds", _BY_DEP, _DEP,
                      legend="{{namespace}}/{{deployment}} ")))
        .with_panel(timeseries_panel(
            "Request latency", "s",
            quantiles("mlxfleet_operator_revision_request_duration_seconds", _BY_DEP, _DEP,
                      legend="{{namespace}}/{{deployment}} ")))
        .with_panel(timeseries_panel(
            "Decode tokens/s per sequence", TOKENS_PER_SECOND,
            quantiles("mlxfleet_operator_revision_decode_tokens_per_second", _BY_DEP, _DEP,
                      qs=(0.5, 0.05), legend="{{namespace}}/{{deployment}} "),
            description="Per-sequence decode rate; p5 is the slow tail."))
        .with_panel(timeseries_panel(
            "Responses/s by status code (agents)", "reqps",
            [(f"sum by (code) (rate(mlxfleet_agent_requests_total{{{_NODE}}}"
              "[$__rate_interval]))", "{{code}}")],
            description="HTTP responses of the agents' API by status code; needs Prometheus to "
                        "scrape the Macs' /metrics (docs/dashboards.md)."))
        .with_panel(timeseries_panel(
            "Replicas per ModelDeployment", "none",
            [('mlxfleet_operator_deployment_replicas{namespace=~"$namespace", '
              'name=~"$deployment"}', "{{namespace}}/{{name}} {{state}}")]))
        .with_panel(table_panel(
            "Served models", [
                (f"mlxfleet_operator_served_model_info{{{_DEP}, {_NODE}}}", "")],
            description="One row per assignment: ModelDeployment, OpenAI model id, revision, "
                        "Mac and role."))
        .with_row(dash.Row("Router"))
        .with_panel(timeseries_panel(
            "Router requests/s by model and code", "reqps",
            [(_router_rate("mlxfleet_router_requests_total", "model, code"),
              "{{model}} {{code}}")],
            description="Client requests the fleet routers answered, by served model name and "
                        "status (499: the client left first; 502 after a 200: the Mac's stream "
                        "broke off)."))
        .with_panel(timeseries_panel(
            "Router requests/s by tenant and code", "reqps",
            [("sum by (tenant, code) (rate(mlxfleet_router_requests_total"
              "[$__rate_interval]))", "{{tenant}} {{code}}")],
            description="Per tenant of the routers' API key file (default: keys without a "
                        "tenant), every model."))
        .with_panel(timeseries_panel(
            "Router time to first token", "s",
            _router_quantiles("mlxfleet_router_time_to_first_token_seconds"),
            description="From a request's arrival at the router to the first body byte relayed "
                        "from a Mac (for a stream, its first token): the agents' TTFT plus the "
                        "router's pick, queue and retries."))
        .with_panel(timeseries_panel(
            "Router request duration", "s",
            _router_quantiles("mlxfleet_router_request_duration_seconds"),
            description="From a request's arrival at the router to the last byte of its "
                        "answer."))
        .with_panel(timeseries_panel(
            "Upstream attempts/s by Mac and result", "ops",
            [(_router_rate("mlxfleet_router_upstream_attempts_total", "model, node, result",
                           _NODE), "{{node}} {{result}}")],
            description="Attempts the routers sent to Macs: ok (an answer began), status (a "
                        "retryable 429/502/503/504), connect_error, reset, timeout."))
        .with_panel(timeseries_panel(
            "Retry decisions/s by reason", "ops",
            [("sum by (model, reason) (rate(mlxfleet_router_retries_total"
              "[$__rate_interval]))", "{{model}} {{reason}}")],
            description="After a failed attempt: Retry (on the next Mac), or why not "
                        "(BytesSent: the answer had begun; the attempt limit or the retry "
                        "budget: at most 10 + 20 % of requests are retries). Every model: "
                        "retries are rare, and one of any deployment is worth seeing."))
        .with_panel(state_panel(
            "Circuit breaker per Mac", [
                (f"max by (node, state) (mlxfleet_router_breaker_state{{{_NODE}}})",
                 "{{node}} {{state}}")],
            description="1 while the Mac's breaker is in that phase (closed, open, half-open) "
                        "in any router: open after > 10 % errors over 30 s, 3 failed probes or a "
                        "refused connection; half-open after the 60 s cooldown."))
        .with_panel(timeseries_panel(
            "Router requests in flight per Mac", "none",
            [(f"sum by (node) (mlxfleet_router_in_flight_requests{{{_NODE}}})", "{{node}}")],
            description="Requests the routers have in flight to each Mac (the load the "
                        "affinity's bound compares)."))
        .with_panel(timeseries_panel(
            "Affinity kept vs spilled", "reqps",
            [(_router_rate("mlxfleet_router_affinity_total", "model, result"),
              "{{model}} {{result}}")],
            description="kept: the first Mac tried owns the session key on the hash ring (its "
                        "prompt cache is there); spilled: the load bound (1.25 x mean in "
                        "flight) sent it to the next Mac.", stacked=True))
        .with_panel(timeseries_panel(
            "Rate-limited requests/s by tenant and limit", "reqps",
            [("sum by (tenant, limit) (rate(mlxfleet_router_rate_limited_total"
              "[$__rate_interval]))", "{{tenant}} {{limit}}")],
            description="429s from a tenant limit (RequestsPerMinute, TokensPerMinute, "
                        "ConcurrentRequests) or the backpressure queue (QueueFull, "
                        "QueueTimeout)."))
        .with_row(dash.Row("Operator"))
        .with_panel(timeseries_panel(
            "Reconciles/s by result", "ops",
            [("sum by (result) (rate(mlxfleet_operator_reconcile_total[$__rate_interval]))",
              "{{result}}")]))
        .with_panel(timeseries_panel(
            "Reconcile duration (10 min windows)", "s",
            [(f"histogram_quantile({q}, sum by (le, result) "
              f"(rate(mlxfleet_operator_reconcile_duration_seconds_bucket[10m])))",
              f"{{{{result}}}} p{round(q * 100)}") for q in (0.5, 0.99)],
            description="Reconciles are sparse in a steady fleet (a spec change, a node "
                        "event): a short window would mostly hold none."))
    )
