"""The Mac dashboard: per Mac, memory by kind, queue depth, batch occupancy, prompt-cache hit
ratio, tokens/s and latencies, model loads/unloads and assignment states (Prefetching =
downloading).

Memory and assignment panels come from the operator's ``/metrics``; the serving panels from the
agent's own ``/metrics`` (a direct scrape of the Mac, with a ``node`` label naming it, see
docs/dashboards.md). Agent series carry ``model`` (the OpenAI model id) and ``revision``.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dash

from .panels import (TOKENS_PER_SECOND, datasource_variable, namespace_variable, node_variable,
                     deployment_variable, quantiles, timeseries_panel)

UID = "mlx-fleet-mac"

_NODE = 'node=~"$node"'
_MR = "node, model, revision"


def _agent_rate(metric: str, by: str = _MR) -> str:
    return f"sum by ({by}) (rate({metric}{{{_NODE}}}[$__rate_interval]))"


def build() -> dash.Dashboard:
    return (
        dash.Dashboard("mlx-fleet / Mac").uid(UID).tags(["mlx-fleet"]).refresh("30s")
        .time("now-1h", "now").timezone("browser")
        .description("One Mac (or several): memory, serving load and model lifecycle.")
        .with_variable(datasource_variable()).with_variable(namespace_variable())
        .with_variable(deployment_variable()).with_variable(node_variable())
        .with_row(dash.Row("Memory"))
        .with_panel(timeseries_panel(
            "Memory by kind", "bytes",
            [(f"mlxfleet_operator_node_memory_total_bytes{{{_NODE}}}", "{{node}} total"),
             (f"mlxfleet_operator_node_memory_budget_bytes{{{_NODE}}}", "{{node}} budget"),
             (f"mlxfleet_operator_node_memory_reserved_bytes{{{_NODE}}}", "{{node}} reserved"),
             (f"mlxfleet_operator_node_memory_total_bytes{{{_NODE}}} - "
              f"mlxfleet_operator_node_memory_available_bytes{{{_NODE}}}", "{{node}} used")],
            description="Total unified memory, the placement budget, the assignments' "
                        "reservations and what is in use (total - available)."))
        .with_panel(timeseries_panel(
            "Resident memory by model", "bytes",
            [(f'sum by (node, deployment, revision) (mlxfleet_operator_assignment_resident_bytes'
              f'{{{_NODE}, namespace=~"$namespace", deployment=~"$deployment"}})',
              "{{node}} {{deployment}} {{revision}}")],
            stacked=True))
        .with_row(dash.Row("Serving"))
        .with_panel(timeseries_panel(
            "Queue depth", "none",
            [(f"sum by ({_MR}) (mlxfleet_agent_queue_depth{{{_NODE}}})",
              "{{node}} {{model}}@{{revision}}")],
            description="Requests waiting for a slot in the running batch."))
        .with_panel(timeseries_panel(
            "Batch occupancy", "none",
            [(f"sum by ({_MR}) (mlxfleet_agent_batch_occupancy{{{_NODE}}})",
              "{{node}} {{model}}@{{revision}}")],
            description="Sequences in the running batch (prefill + decode)."))
        .with_panel(timeseries_panel(
            "Prompt-cache hit ratio", "percentunit",
            [(f"{_agent_rate('mlxfleet_agent_prompt_cache_tokens_total')} / "
              f"{_agent_rate('mlxfleet_agent_prompt_tokens_total')}",
              "{{node}} {{model}}@{{revision}}")],
            description="Prompt tokens served from the prompt cache / prompt tokens."))
        .with_panel(timeseries_panel(
            "Generated tokens/s", TOKENS_PER_SECOND,
            [(_agent_rate("mlxfleet_agent_generated_tokens_total"),
              "{{node}} {{model}}@{{revision}}")]))
        .with_panel(timeseries_panel(
            "Time to first token", "s",
            quantiles("mlxfleet_agent_time_to_first_token_seconds", "node", _NODE,
                      qs=(0.5, 0.95), legend="{{node}} ")))
        .with_panel(timeseries_panel(
            "Inter-token latency", "s",
            quantiles("mlxfleet_agent_inter_token_latency_seconds", "node", _NODE,
                      qs=(0.5, 0.95), legend="{{node}} ")))
        .with_row(dash.Row("Models"))
        .with_panel(timeseries_panel(
            "Models loaded", "none",
            [(f"mlxfleet_agent_model_loaded{{{_NODE}}}", "{{node}} {{model}}@{{revision}}")],
            description="1 while loaded; a step down to 0 is an unload."))
        .with_panel(timeseries_panel(
            "Model loads since the agent started", "none",
            [(f"sum by ({_MR}) (mlxfleet_agent_model_load_seconds_count{{{_NODE}}})",
              "{{node}} {{model}}@{{revision}}")],
            description="Completed loads per model (a counter: a step up is a load)."))
        .with_panel(timeseries_panel(
            "Assignments by state", "none",
            [(f"sum by (node, state) (mlxfleet_operator_assignment_state{{{_NODE}}}) > 0",
              "{{node}} {{state}}")],
            description="Prefetching = downloading the model, Loading, Ready, Unloading, "
                        "Failed.", stacked=True))
        .with_panel(timeseries_panel(
            "Mean model load duration", "s",
            [(f"sum by ({_MR}) (mlxfleet_agent_model_load_seconds_sum{{{_NODE}}})"
              f" / sum by ({_MR}) (mlxfleet_agent_model_load_seconds_count{{{_NODE}}})",
              "{{node}} {{model}}@{{revision}}")],
            description="Mean duration of the model's loads since the agent started (loads "
                        "are rare: a rate over a window would mostly be empty)."))
    )
