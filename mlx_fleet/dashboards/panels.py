"""Building blocks shared by the three dashboards: the data source and template variables, and
panel constructors that always set a unit (every panel of every dashboard has one).

Queries are PromQL over the metrics listed in docs/metrics.md. They use Grafana's
``$__rate_interval`` for ``rate()`` windows and ``$__range`` for "over the dashboard's time
range" sums, and the template variables ``$namespace``, ``$deployment`` and ``$node`` as regex
matchers (``=~``), so the "All" option (``.*``) works.

Units are Grafana unit ids (https://grafana.com/docs/grafana/latest/panels-visualizations/
configure-standard-options/#unit): ``bytes`` (IEC), ``s``, ``reqps``, ``percent`` (0-100),
``percentunit`` (0-1), ``none``; ``suffix:<text>`` for a custom suffix (tokens/s).
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import prometheus, stat, statetimeline, table, timeseries
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.prometheus import PromQueryFormat
from grafana_foundation_sdk.models.dashboard import (DataSourceRef, VariableRefresh,
                                                     VariableSort)

#: The data source every query uses: the dashboard's ``datasource`` variable (a Prometheus).
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")

#: Custom unit of token rates.
TOKENS_PER_SECOND = "suffix: tokens/s"

Query = tuple[str, str]
"""``(PromQL expression, legend format)``."""


def datasource_variable() -> dash.DatasourceVariable:
    return dash.DatasourceVariable("datasource").label("Data source").type("prometheus")


def label_variable(name: str, label: str, metric_selector: str) -> dash.QueryVariable:
    """A multi-value variable over the values of label ``name`` on ``metric_selector`` (with an
    "All" option matching everything)."""
    return (dash.QueryVariable(name).label(label).datasource(DATASOURCE)
            .query(f"label_values({metric_selector}, {name})")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC)
            .multi(True).include_all(True).all_value(".*"))


def namespace_variable() -> dash.QueryVariable:
    return label_variable("namespace", "Namespace", "mlxfleet_operator_served_model_info")


def deployment_variable() -> dash.QueryVariable:
    return label_variable("deployment", "ModelDeployment",
                          'mlxfleet_operator_served_model_info{namespace=~"$namespace"}')


def node_variable() -> dash.QueryVariable:
    return label_variable("node", "Mac", "mlxfleet_operator_node_info")


def _targets(panel, queries: list[Query], *, instant: bool = False, table_format: bool = False):
    for i, (expr, legend) in enumerate(queries):
        q = prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(chr(ord("A") + i))
        if instant:
            q = q.instant()
        if table_format:
            q = q.format(PromQueryFormat.TABLE)
        panel = panel.with_target(q)
    return panel


def timeseries_panel(title: str, unit: str, queries: list[Query], *, description: str = "",
                     width: int = 12, height: int = 8, stacked: bool = False,
                     min_zero: bool = True) -> timeseries.Panel:
    p = (timeseries.Panel().title(title).description(description).unit(unit)
         .datasource(DATASOURCE).span(width).height(height).fill_opacity(10)
         .legend(common_b.VizLegendOptions().display_mode(common.LegendDisplayMode.LIST)
                 .placement(common.LegendPlacement.BOTTOM).show_legend(True)))
    if min_zero:
        p = p.min(0)
    if stacked:
        p = p.stacking(common_b.StackingConfig().mode(common.StackingMode.NORMAL))
    return _targets(p, queries)


def stat_panel(title: str, unit: str, queries: list[Query], *, description: str = "",
               width: int = 6, height: int = 4) -> stat.Panel:
    p = (stat.Panel().title(title).description(description).unit(unit).datasource(DATASOURCE)
         .span(width).height(height).graph_mode(common.BigValueGraphMode.AREA)
         .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"])))
    return _targets(p, queries, instant=False)


def state_panel(title: str, queries: list[Query], *, description: str = "", width: int = 24,
                height: int = 6) -> statetimeline.Panel:
    """A state timeline of 0/1 series (a phase or state that is 1 while current)."""
    p = (statetimeline.Panel().title(title).description(description).unit("none")
         .datasource(DATASOURCE).span(width).height(height))
    return _targets(p, queries)


def table_panel(title: str, queries: list[Query], *, description: str = "", width: int = 24,
                height: int = 8) -> table.Panel:
    p = (table.Panel().title(title).description(description).unit("none").datasource(DATASOURCE)
         .span(width).height(height))
    return _targets(p, queries, instant=True, table_format=True)


def quantiles(metric: str, by: str, selector: str, qs: tuple[float, ...] = (0.5, 0.95, 0.99),
              legend: str = "") -> list[Query]:
    """``histogram_quantile`` of ``metric``'s buckets for each of ``qs``, summed ``by`` the
    given labels (``le`` added), over ``$__rate_interval``."""
    return [(f"histogram_quantile({q}, sum by (le, {by}) "
             f"(rate({metric}_bucket{{{selector}}}[$__rate_interval])))",
             f"{legend}p{round(q * 100)}") for q in qs]
