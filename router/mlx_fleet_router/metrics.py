"""The fleet router's Prometheus metrics (issue #17 §5), on the router's own registry.

Every label value comes from a bounded set: ``model`` is a served name of the routing table
(``unknown`` for any other), ``tenant`` a tenant of the key file (``default`` without one),
``node`` a Mac of the table, and ``reason``/``result``/``limit``/``state`` the fixed labels of
the decision modules.

* ``mlxfleet_router_requests_total{model,code,tenant}`` — client requests by answer status
  (``499``: the client left first; ``502``: the Mac's answer broke off after its first byte
  had gone to the client — its status line said 200, the stream was cut);
* ``mlxfleet_router_request_duration_seconds{model}`` — from the request's arrival to the last
  byte of its answer;
* ``mlxfleet_router_time_to_first_token_seconds{model}`` — from arrival to the first body byte
  relayed from a Mac (for a stream, its first event: the first token);
* ``mlxfleet_router_upstream_attempts_total{model,node,result}`` — attempts sent to Macs;
  ``result``: ``ok`` (a status line came back, not retryable), ``status`` (a retryable status),
  ``connect_error``, ``reset``, ``timeout`` (:class:`mlx_fleet_router.retry.Outcome` kinds);
* ``mlxfleet_router_retries_total{model,reason}`` — after a failed attempt, the retry
  decision (:class:`mlx_fleet_router.retry.Decision` reasons: ``Retry`` or why not);
* ``mlxfleet_router_in_flight_requests{node}`` — this router's requests in flight per Mac;
* ``mlxfleet_router_breaker_state{node,state}`` — 1 for the Mac's breaker phase
  (``closed``, ``open``, ``half-open``), 0 for the others (as ``kube_pod_status_phase``);
* ``mlxfleet_router_affinity_total{model,result}`` — ``kept``: the first Mac tried was the
  session key's ring owner; ``spilled``: the load bound sent it on;
* ``mlxfleet_router_rate_limited_total{tenant,limit}`` — requests refused with 429 by a
  tenant limit (``RequestsPerMinute``, ``TokensPerMinute``, ``ConcurrentRequests``) or by the
  backpressure queue (``QueueFull``, ``QueueTimeout``).

Histogram buckets: :data:`mlx_fleet.contract.LATENCY_BOUNDS_SECONDS`, the fleet's request
latency bounds (the agents' per-revision statistics use them too).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from mlx_fleet.contract import LATENCY_BOUNDS_SECONDS

from .breaker import Phase

__all__ = ["RouterMetrics", "UNKNOWN_MODEL"]

#: The ``model`` label of a request naming no served model of the table.
UNKNOWN_MODEL = "unknown"


class RouterMetrics:
    """The router's metrics on ``registry`` (module docstring)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter("mlxfleet_router_requests_total",
                                "Client requests by served model, answer status and tenant",
                                ["model", "code", "tenant"], registry=registry)
        self.duration = Histogram("mlxfleet_router_request_duration_seconds",
                                  "Time from a request's arrival to the end of its answer",
                                  ["model"], buckets=LATENCY_BOUNDS_SECONDS, registry=registry)
        self.ttft = Histogram("mlxfleet_router_time_to_first_token_seconds",
                              "Time from a request's arrival to the first body byte relayed "
                              "from a Mac", ["model"], buckets=LATENCY_BOUNDS_SECONDS,
                              registry=registry)
        self.attempts = Counter("mlxfleet_router_upstream_attempts_total",
                                "Attempts sent to Macs by result", ["model", "node", "result"],
                                registry=registry)
        self.retries = Counter("mlxfleet_router_retries_total",
                               "Retry decisions after a failed attempt, by reason",
                               ["model", "reason"], registry=registry)
        self.in_flight = Gauge("mlxfleet_router_in_flight_requests",
                               "This router's requests in flight per Mac", ["node"],
                               registry=registry)
        self.breaker = Gauge("mlxfleet_router_breaker_state",
                             "1 for the circuit breaker phase of a Mac, 0 for the others",
                             ["node", "state"], registry=registry)
        self.affinity = Counter("mlxfleet_router_affinity_total",
                                "Requests sent first to their session's ring owner (kept) or "
                                "past it by the load bound (spilled)", ["model", "result"],
                                registry=registry)
        self.rate_limited = Counter("mlxfleet_router_rate_limited_total",
                                    "Requests refused with 429 by a tenant limit or the "
                                    "backpressure queue", ["tenant", "limit"],
                                    registry=registry)

    def set_breaker(self, node: str, phase: Phase) -> None:
        """Export ``node``'s breaker phase (one series per phase, 1 for the current one)."""
        for p in Phase:
            self.breaker.labels(node, p.value).set(1.0 if p is phase else 0.0)

    def forget_node(self, node: str) -> None:
        """Drop a Mac's series once it left the routing table (bounded label sets)."""
        for p in Phase:
            try:
                self.breaker.remove(node, p.value)
            except KeyError:
                pass
        try:
            self.in_flight.remove(node)
        except KeyError:
            pass
