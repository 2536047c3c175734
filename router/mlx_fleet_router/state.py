"""The fleet router's runtime state and tunables: what one router process remembers between
requests (the thin, mutable side of the pure decisions it feeds).

:class:`RouterSettings` holds the decision modules' configurations; :class:`RouterState` the
Macs' breakers, in-flight counts, the retry budget, the tenants' buckets, the queue lengths and
the hash rings — one instance per app (:func:`mlx_fleet_router.app.build_app`), never module
globals. Every change goes through a pure step of :mod:`~mlx_fleet_router.breaker`,
:mod:`~mlx_fleet_router.retry`, :mod:`~mlx_fleet_router.limits` or
:mod:`~mlx_fleet_router.picker`; this module only keeps the results and exports the gauges.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from . import breaker, limits, retry
from .metrics import RouterMetrics
from .picker import LOAD_FACTOR, Candidate, Ring
from .table import Served, Table

__all__ = ["RouterSettings", "RouterState"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterSettings:
    """The router's tunables (every default is its decision module's).

    ``admission_batches`` (2): a Mac counts as at its admission limit with
    ``batch_limit × admission_batches`` of this router's requests in flight — the agent's
    default admission takes a running batch plus one batch waiting
    (``node_agent.serving.admission.KV_BUDGET_BATCHES``, 2) before it answers 429.
    ``tenant_limits``: per tenant, else ``default_limits`` (none by default).
    ``probe_interval_seconds``: health probes of every Mac (0: none)."""

    breaker: breaker.BreakerConfig = field(default_factory=breaker.BreakerConfig)
    retry: retry.RetryConfig = field(default_factory=retry.RetryConfig)
    queue: limits.QueueConfig = field(default_factory=limits.QueueConfig)
    load_factor: float = LOAD_FACTOR
    admission_batches: int = 2
    tenant_limits: Mapping[str, limits.TenantLimits] = field(default_factory=dict)
    default_limits: limits.TenantLimits = field(default_factory=limits.TenantLimits)
    probe_interval_seconds: float = 5.0


class RouterState:
    """One router process's runtime state (per app, never module globals): the Macs' breakers,
    in-flight counts per (deployment, Mac), the retry budget, tenants' buckets, the queue
    lengths per deployment and the hash rings per deployment."""

    def __init__(self, settings: RouterSettings, metrics: RouterMetrics,
                 clock: Callable[[], float]) -> None:
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
        self.breakers: dict[str, breaker.State] = {}
        self.in_flight: dict[tuple[str, str], int] = {}
        self.budget = retry.Budget()
        self.tenants: dict[str, limits.TenantState] = {}
        self.queued: dict[str, int] = {}
        self._rings: dict[str, Ring] = {}
        self._released = asyncio.Event()

    def ring(self, served: Served) -> Ring:
        """The deployment's hash ring, rebuilt only when its set of Macs changed."""
        names = frozenset(r.node for r in served.replicas)
        ring = self._rings.get(served.deployment)
        if ring is None or ring.names != names:
            ring = self._rings[served.deployment] = Ring.build(names)
        return ring

    def candidates(self, served: Served) -> list[Candidate]:
        s = self.settings
        return [Candidate(r.node, r.revision, r.endpoint,
                          in_flight=self.in_flight.get((served.deployment, r.node), 0),
                          breaker=self.breakers.get(r.node, breaker.CLOSED),
                          cordoned=r.cordoned,
                          max_in_flight=r.batch_limit * s.admission_batches,
                          capabilities=r.capabilities, task=r.task)
                for r in served.replicas]

    def feed(self, node: str, event: breaker.Event) -> None:
        """Step ``node``'s breaker with ``event`` now, and export its phase."""
        now = self.clock()
        before = self.breakers.get(node, breaker.CLOSED)
        after = breaker.step(self.settings.breaker, before, event, now)
        self.breakers[node] = after
        if after.phase is not before.phase:
            log.info("breaker of %s: %s → %s (%s)", node, before.phase.value, after.phase.value,
                     after.reason or "-")
        self.metrics.set_breaker(node, breaker.phase(self.settings.breaker, after, now))

    def admits(self, node: str) -> bool:
        return breaker.admits(self.settings.breaker, self.breakers.get(node, breaker.CLOSED),
                              self.clock())

    def enter(self, deployment: str, node: str) -> None:
        key = (deployment, node)
        self.in_flight[key] = self.in_flight.get(key, 0) + 1
        self.metrics.in_flight.labels(node).inc()

    def leave(self, deployment: str, node: str) -> None:
        key = (deployment, node)
        n = self.in_flight.get(key, 0) - 1
        if n > 0:
            self.in_flight[key] = n
        else:
            self.in_flight.pop(key, None)
        self.metrics.in_flight.labels(node).dec()
        released, self._released = self._released, asyncio.Event()
        released.set()

    async def wait_release(self, timeout: float) -> None:
        """Until some request leaves a Mac, or ``timeout`` seconds."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._released.wait(), timeout)

    def forget(self, table: Table) -> None:
        """Drop the state of Macs no longer in ``table`` (and with no request in flight), and
        the rings of deployments no longer in it."""
        nodes = {r.node for s in table.models.values() for r in s.replicas}
        busy = {n for (_, n) in self.in_flight}
        for node in set(self.breakers) - nodes - busy:
            del self.breakers[node]
            self.metrics.forget_node(node)
        deployments = {s.deployment for s in table.models.values()}
        for dep in set(self._rings) - deployments:
            del self._rings[dep]
