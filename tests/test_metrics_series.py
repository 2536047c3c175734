"""AgentMetrics.series (node_agent/metrics.py): the per-token series of a revision, looked up
once; remove_revision drops them with the revision's other series."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from node_agent.metrics import AgentMetrics


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_series_are_the_labelled_children_and_kept() -> None:
    registry = CollectorRegistry()
    m = AgentMetrics(registry)
    s = m.series("m", "r1")
    assert m.series("m", "r1") is s
    assert s.generated_tokens is m.generated_tokens.labels("m", "r1")
    s.generated_tokens.inc(3)
    s.inter_token.observe(0.002)
    s.batch_occupancy.set(5)
    assert _value(registry, "mlxfleet_agent_generated_tokens_total", model="m", revision="r1") == 3
    assert _value(registry, "mlxfleet_agent_inter_token_latency_seconds_count", model="m",
                  revision="r1") == 1
    assert _value(registry, "mlxfleet_agent_batch_occupancy", model="m", revision="r1") == 5
    assert m.series("m", "r2") is not s


def test_remove_revision_drops_them_and_a_later_use_starts_afresh() -> None:
    registry = CollectorRegistry()
    m = AgentMetrics(registry)
    m.series("m", "r1").generated_tokens.inc(7)
    m.series("m", "r2").generated_tokens.inc(1)
    m.remove_revision("m", "r1")
    assert _value(registry, "mlxfleet_agent_generated_tokens_total", model="m",
                  revision="r1") is None
    assert _value(registry, "mlxfleet_agent_generated_tokens_total", model="m", revision="r2") == 1
    m.series("m", "r1").generated_tokens.inc()   # loaded again: a new series, exported
    assert _value(registry, "mlxfleet_agent_generated_tokens_total", model="m", revision="r1") == 1
