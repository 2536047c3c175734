"""Prometheus metrics of the operator (served by ``prometheus_client`` on ``--metrics-port``).

=====================================================  ===========================================
``mlxfleet_operator_reconcile_total{result}``          reconciles by outcome: ``changed`` (a
                                                       transaction was written), ``unchanged``,
                                                       ``invalid`` (bad spec), ``conflict``,
                                                       ``error``
``mlxfleet_operator_reconcile_duration_seconds``       histogram of one reconcile (etcd read,
                                                       placement, transaction, status patch)
``mlxfleet_operator_etcd_txn_conflicts_total``         fenced transactions that failed their
                                                       compares (someone wrote in between)
``mlxfleet_operator_nodes{health}``                    node records in etcd by health
``mlxfleet_operator_deployment_replicas``              replicas per ModelDeployment,
``{namespace,name,state}``                             ``state`` = ``desired`` or ``ready``
``mlxfleet_operator_canary_weight``                    a Canary's candidate weight, percent
``{namespace,name,target}``
``mlxfleet_operator_canary_phase``                     1 for the Canary's current phase, else 0
``{namespace,name,phase}``
``mlxfleet_operator_canary_transitions_total``         Canary phase transitions by the phase
``{namespace,name,phase}``                             entered (RolledBack, Succeeded ...)
=====================================================  ===========================================
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import Counter, Gauge, Histogram

from mlx_fleet.contract import NodeHealth, NodeRecord

RECONCILE_TOTAL = Counter("mlxfleet_operator_reconcile_total",
                          "ModelDeployment reconciles by result", ["result"])
RECONCILE_DURATION = Histogram("mlxfleet_operator_reconcile_duration_seconds",
                               "Duration of one ModelDeployment reconcile in seconds")
TXN_CONFLICTS = Counter("mlxfleet_operator_etcd_txn_conflicts_total",
                        "Fenced etcd transactions that failed their mod_revision compares")
NODES = Gauge("mlxfleet_operator_nodes", "Node records in etcd by health", ["health"])
DEPLOYMENT_REPLICAS = Gauge("mlxfleet_operator_deployment_replicas",
                            "Replicas of a ModelDeployment by state (desired, ready)",
                            ["namespace", "name", "state"])

CANARY_WEIGHT = Gauge("mlxfleet_operator_canary_weight",
                      "Percent of a Canary's sessions sent to its candidate revision",
                      ["namespace", "name", "target"])
CANARY_PHASE = Gauge("mlxfleet_operator_canary_phase",
                     "1 for the Canary's current phase, 0 for the others",
                     ["namespace", "name", "phase"])
CANARY_TRANSITIONS = Counter("mlxfleet_operator_canary_transitions_total",
                             "Canary phase transitions by the phase entered",
                             ["namespace", "name", "phase"])
CANARY_PHASES = ("Pending", "Progressing", "Paused", "Promoting", "Succeeded", "RolledBack",
                 "Aborted", "Failed")

for _result in ("changed", "unchanged", "invalid", "conflict", "error"):
    RECONCILE_TOTAL.labels(result=_result)


def set_nodes(records: Iterable[NodeRecord]) -> None:
    counts = {h.value: 0 for h in NodeHealth}
    for r in records:
        counts[r.health.value] = counts.get(r.health.value, 0) + 1
    for health, n in counts.items():
        NODES.labels(health=health).set(n)


def set_replicas(namespace: str, name: str, desired: int, ready: int) -> None:
    DEPLOYMENT_REPLICAS.labels(namespace=namespace, name=name, state="desired").set(desired)
    DEPLOYMENT_REPLICAS.labels(namespace=namespace, name=name, state="ready").set(ready)


def forget_deployment(namespace: str, name: str) -> None:
    for state in ("desired", "ready"):
        try:
            DEPLOYMENT_REPLICAS.remove(namespace, name, state)
        except KeyError:
            pass


def set_canary(namespace: str, name: str, target: str, phase: str, weight: int) -> None:
    CANARY_WEIGHT.labels(namespace=namespace, name=name, target=target).set(weight)
    for p in CANARY_PHASES:
        CANARY_PHASE.labels(namespace=namespace, name=name, phase=p).set(1 if p == phase else 0)


def forget_canary(namespace: str, name: str) -> None:
    """Remove a deleted Canary's series (no stale gauges)."""
    for metric in (CANARY_WEIGHT, CANARY_PHASE, CANARY_TRANSITIONS):
        for labels in [k for k in metric._metrics if k[:2] == (namespace, name)]:  # noqa: SLF001
            metric.remove(*labels)


_SERVED_PORT: int | None = None


def serve(port: int) -> None:
    """Serve ``/metrics`` on ``0.0.0.0:port`` (once per process; a second call is a no-op).
    Raises ``OSError`` when the port cannot be bound (in use, no permission)."""
    global _SERVED_PORT
    if not port or _SERVED_PORT is not None:
        return
    from prometheus_client import start_http_server

    start_http_server(port)
    _SERVED_PORT = port
