"""Prometheus metrics of the operator (served by ``prometheus_client`` on ``--metrics-port``).

Every metric, with its type, labels and meaning, is listed in docs/metrics.md, which
scripts/gen_metrics_docs.py generates from this registry (tests/test_metrics_docs.py fails when
the two drift apart).

Two kinds live here:

* event metrics the handlers update as things happen: reconciles by result and their duration
  (``result`` = ``success``/``failure``), etcd transaction conflicts, watch restarts, replicas per
  ModelDeployment, Canary weight/phase/transitions;
* the fleet state (nodes, memory, assignments, served models, per-revision request statistics),
  built at scrape time from the operator's etcd views by
  :class:`~.fleet_metrics.FleetCollector`, registered once by :func:`register_fleet`.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Awaitable, Callable
from typing import TypeVar

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram


from .fleet_metrics import FleetCollector, FleetState

#: What a follower lists (its snapshot type).
S = TypeVar("S")

RECONCILE_TOTAL = Counter("mlxfleet_operator_reconcile_total",
                          "ModelDeployment reconciles by result: changed (a transaction was "
                          "written), unchanged, invalid (bad spec), conflict, error", ["result"])
#: Reconcile durations include the wait for the placement lock (every reconcile of the process
#: is serialised on it): a burst of hundreds of deployments queues for tens of seconds, beyond
#: prometheus_client's default top bucket (10 s), so the buckets go to two minutes.
RECONCILE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0,
                     60.0, 120.0)
RECONCILE_DURATIONS = Histogram(
    "mlxfleet_operator_reconcile_duration_seconds",
    "Duration of one ModelDeployment reconcile (the wait for the placement lock, etcd read, "
    "placement, transaction, status patch) by result: success (changed, unchanged) or failure "
    "(invalid, conflict, error)", ["result"], buckets=RECONCILE_BUCKETS)
#: The successful reconciles' child (``RECONCILE_DURATION.observe(seconds)``, as before the
#: ``result`` label); failures go through :func:`observe_reconcile`.
RECONCILE_DURATION = RECONCILE_DURATIONS.labels(result="success")
RECONCILE_DURATIONS.labels(result="failure")
TXN_CONFLICTS = Counter("mlxfleet_operator_etcd_txn_conflicts_total",
                        "Fenced etcd transactions that failed their mod_revision compares")
WATCH_RESTARTS = Counter("mlxfleet_operator_watch_restarts_total",
                         "Re-lists of a followed etcd prefix after its first list (its watch "
                         "revision was compacted, or the follower was restarted)", ["watch"])
#: The ``watch`` label values: the followed key prefixes.
WATCHES = ("nodes", "reports", "stats", "assignments")
for _watch in WATCHES:
    WATCH_RESTARTS.labels(watch=_watch)
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


def observe_reconcile(seconds: float, *, success: bool) -> None:
    """Record one reconcile's duration under ``result="success"`` or ``result="failure"``."""
    RECONCILE_DURATIONS.labels(result="success" if success else "failure").observe(seconds)


def watch_restarted(watch: str) -> None:
    """Count one restart of the follower of ``watch`` (one of :data:`WATCHES`). Raises
    ``ValueError`` for another value (labels stay bounded)."""
    if watch not in WATCHES:
        raise ValueError(f"unknown watch {watch!r}: one of {', '.join(WATCHES)}")
    WATCH_RESTARTS.labels(watch=watch).inc()


def relists_counted(watch: str, on_snapshot: Callable[[S], Awaitable[None]]
                    ) -> Callable[[S], Awaitable[None]]:
    """``on_snapshot`` (a follower's list callback) wrapped to call :func:`watch_restarted`
    for every list after the first. Wrap once per follower, outside its supervised run, so
    that a restarted follower's list counts too. Raises ``ValueError`` for an unknown
    ``watch``."""
    if watch not in WATCHES:
        raise ValueError(f"unknown watch {watch!r}: one of {', '.join(WATCHES)}")
    listed = False

    async def counted(snapshot: S) -> None:
        nonlocal listed
        if listed:
            watch_restarted(watch)
        listed = True
        await on_snapshot(snapshot)

    return counted


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


_FLEET: weakref.WeakKeyDictionary[CollectorRegistry, FleetCollector] = weakref.WeakKeyDictionary()
_FLEET_LOCK = threading.Lock()


def register_fleet(runtime_getter: Callable[[], FleetState | None],
                   registry: CollectorRegistry = REGISTRY) -> FleetCollector:
    """Register the :class:`~.fleet_metrics.FleetCollector` over ``runtime_getter()`` (the
    operator's Runtime, or None while it starts) on ``registry`` (default: the one ``/metrics``
    serves). Idempotent: a later call for the same registry registers nothing and only points
    the existing collector at the new ``runtime_getter``; returns the collector."""
    with _FLEET_LOCK:
        collector = _FLEET.get(registry)
        if collector is None:
            collector = FleetCollector(runtime_getter)
            registry.register(collector)
            _FLEET[registry] = collector
        else:
            collector.runtime_getter = runtime_getter
        return collector


def serve(port: int) -> None:
    """Serve ``/metrics`` on ``0.0.0.0:port`` in a thread (``port`` 0: not at all). Call it once
    per process (:func:`~.main.main`'s pre-flight check, or the start-up handler when the
    operator runs under ``kopf run``: ``OperatorConfig.metrics_served`` says which). Raises
    ``OSError`` when the port cannot be bound (in use, no permission)."""
    if not port:
        return
    from prometheus_client import start_http_server

    start_http_server(port)
