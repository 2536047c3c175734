"""The agent's presence in etcd: its node record and its reports, bound to one lease.

:class:`Registration` grants a lease (TTL ``ttl`` seconds, default 15), puts the
:class:`~mlx_fleet.contract.NodeRecord` at ``keys.node(name)`` attached to it and keeps the lease
alive every ``ttl / 3`` seconds. The one-third interval is etcd's own guidance: the etcd client
(``clientv3``'s ``KeepAlive``) sends a keep-alive every ``TTL/3`` so that two consecutive lost
requests still leave the lease alive (etcd docs, "Interacting with etcd → Lease keep-alives";
``clientv3/lease.go``: ``nextKeepAlive = now + TTL/3``). Three details keep that guarantee:

* keep-alives are sent by a task of their own that does nothing else (no record or report
  write, no lock), so a slow or hung write can never delay them; the writes run in a second
  task (the *sync* task) and in :meth:`put_report` / :meth:`delete_report`;
* each keep-alive is bounded to ``ttl / 3`` (the store's 10 s RPC deadline could otherwise eat
  the whole lease; a keep-alive that times out counts as a failed one), and so is every
  individual write (:attr:`Registration.write_timeout`; a write that times out counts as failed
  and is retried), so the write lock is never held for long;
* keep-alives follow a fixed monotonic cadence (:func:`next_deadline`: the previous deadline
  plus ``ttl / 3``, not "sleep after the work"), so the period does not drift by the time each
  one takes.

Every key the agent writes is written here, under the current lease:

* the node record, rewritten only when it *materially* changes (health, or capacity per
  :func:`~node_agent.capacity.materially_different`), never on a mere heartbeat;
* assignment reports (:meth:`put_report` / :meth:`delete_report`): the latest report per key is
  remembered so it can be re-written; a write that fails is retried by the sync task within
  ``ttl / 3``.

Recovery: if a keep-alive says the lease is gone (TTL ≤ 0: expired, or revoked behind the
agent's back) or etcd stayed unreachable for longer than the TTL, the agent grants a *new*
lease (in the sync task; the keep-alive task only notices and wakes it) and re-puts the node
record and every current report in one transaction, so a
partitioned or stalled agent comes back by itself. :meth:`stop` revokes the lease, so the record
and reports vanish at once rather than after the TTL.

Both tasks (keep-alive and sync) run under :class:`mlx_fleet.supervise.Supervised`, as do the
controller's tasks: a bug that escapes one is logged with its traceback and the task restarts after a
capped back-off instead of ending silently; while it waits, the agent's ``/health`` says 503.

Only asyncio is used; the store's calls are coroutines and nothing blocks the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from mlx_fleet.capabilities import Task
from mlx_fleet.contract import (AssignmentReport, Keys, NodeCapacity, NodeHealth, NodeRecord,
                                StatsReport)

#: A lease-bound record the agent writes: a per-assignment report or a per-deployment stats
#: report (both carry ``updated_unix``, ignored when comparing).
LeaseBound = AssignmentReport | StatsReport
from mlx_fleet.store import Put, Store, StoreError
from mlx_fleet.supervise import SUPERVISOR_INITIAL_BACKOFF, Supervised

from .capacity import materially_different

log = logging.getLogger(__name__)

__all__ = ["Registration", "DEFAULT_LEASE_TTL", "next_deadline"]

#: Default lease TTL in seconds: a dead Mac disappears from placement within ~15 s.
DEFAULT_LEASE_TTL = 15

#: etcd's default ``--max-txn-ops``; re-registration splits its puts into chunks of this size.
_MAX_TXN_OPS = 128


def next_deadline(previous: float, period: float, now: float) -> float:
    """When the next periodic beat is due (monotonic seconds), given the ``previous`` deadline.

    Fixed cadence: ``previous + period``, however long the beat took. When that moment has
    already passed (a beat overran a whole period, or the loop stalled), the beat is due ``now``
    and the cadence restarts from there: one late beat, never a burst of catch-up beats.
    """
    due = previous + period
    return due if due > now else now


def _same_report(a: LeaseBound | None, b: LeaseBound) -> bool:
    if a is None or type(a) is not type(b):
        return False
    return a.model_dump(exclude={"updated_unix"}) == b.model_dump(exclude={"updated_unix"})


class Registration:
    """Registers ``node_name`` in etcd and keeps it registered until :meth:`stop`.

    ``store``: the project's :class:`~mlx_fleet.store.Store`; ``keys``: the contract layout.
    ``address``: the agent's advertised base URL (``NodeRecord.address``).
    ``capacity``: a coroutine function returning the current :class:`NodeCapacity`, called once
    per heartbeat (:meth:`node_agent.capacity.CapacityProbe.read`).
    ``health``: returns the node's current :class:`NodeHealth`, read on every beat like
    ``capacity`` (the agent reports Degraded while its serving core has failed, so the operator
    places nothing new there); a change rewrites the record on that beat.
    ``serving_options``: the serving core's switches (``ServingOptions.as_record()``), written
    into the record as ``serving_options``. ``tasks``: the model tasks the agent serves
    (``NodeRecord.tasks``; None: the record's default, text generation only).
    ``ttl``: lease TTL in whole seconds (≥ 1; default :data:`DEFAULT_LEASE_TTL`).
    ``available_threshold_bytes``: how far available memory must move before the record is
    rewritten (default: see :func:`~node_agent.capacity.materially_different`).

    :meth:`start` raises :class:`~mlx_fleet.store.StoreError` when the first registration
    fails; after that, failures are handled inside the heartbeat loop.
    """

    def __init__(self, store: Store, keys: Keys, *, node_name: str, address: str,
                 capacity: Callable[[], Awaitable[NodeCapacity]],
                 health: Callable[[], NodeHealth] = lambda: NodeHealth.HEALTHY,
                 labels: dict[str, str] | None = None, ttl: int = DEFAULT_LEASE_TTL,
                 agent_version: str = "",
                 serving_options: dict[str, str] | None = None,
                 tasks: list[Task] | None = None,
                 available_threshold_bytes: int | None = None) -> None:
        if ttl < 1:
            raise ValueError(f"lease TTL must be at least 1 second, got {ttl}")
        self._store = store
        self._keys = keys
        self.node_name = node_name
        self.key = keys.node(node_name)
        self.address = address
        self.labels = dict(labels or {})
        self.ttl = ttl
        self.agent_version = agent_version
        self.serving_options = dict(serving_options or {})
        self.model_tasks = None if tasks is None else list(tasks)
        self._capacity_fn = capacity
        self._health_fn = health
        self._threshold = available_threshold_bytes

        self._lease_id: int | None = None
        self._health = NodeHealth.HEALTHY
        self._capacity: NodeCapacity | None = None
        self._record_dirty = True
        self._reports: dict[str, LeaseBound] = {}
        self._dirty_reports: set[str] = set()       # keys whose latest state isn't in etcd
        self._pending_deletes: set[str] = set()
        self._last_ok = 0.0                         # monotonic time of the last etcd success
        self._etcd_ok = False
        self._lease_alive = False
        self._lock = asyncio.Lock()                 # serializes every lease-bound write
        self._wake = asyncio.Event()                # wakes the sync task early
        # A bug in either loop restarts it soon: within one keep-alive interval.
        backoff = dict(initial_backoff=min(SUPERVISOR_INITIAL_BACKOFF, ttl / 3),
                       max_backoff=ttl / 3)
        # Keep-alives only, on a fixed cadence: nothing else may delay them (module doc).
        self._keepalive_task = Supervised(f"registration:{node_name}:keepalive",
                                          self._keepalive_loop, **backoff)
        # (Re-)registration, record rewrites and report retries.
        self._sync_task = Supervised(f"registration:{node_name}:sync", self._sync_loop,
                                     **backoff)
        self._stopping = False
        #: Incremented whenever a new lease is granted (tests and logs use it).
        self.registrations = 0

    # -- views -------------------------------------------------------------------------------
    @property
    def lease_id(self) -> int | None:
        """The current lease ID (reports are written under it), or None before registering."""
        return self._lease_id

    @property
    def healthy(self) -> bool:
        """True while the lease is alive and etcd answered within the last TTL."""
        return (self._lease_alive and self._etcd_ok
                and time.monotonic() - self._last_ok <= self.ttl)

    @property
    def health(self) -> NodeHealth:
        return self._health

    def connectivity_problem(self) -> str | None:
        """Why the agent's link to etcd is degraded, or None while it is not: ``"etcd
        unreachable"``, ``"lease not alive"`` (being re-established) or ``"no answer from etcd
        within the lease TTL"``. Models already loaded keep serving meanwhile (nothing is
        unloaded for want of etcd); only changes to the assignments wait. ``/health`` reports
        such a node ``degraded`` (see ``node_agent.main.health_verdict``)."""
        if self.healthy:
            return None
        return ("etcd unreachable" if not self._etcd_ok else
                "lease not alive" if not self._lease_alive else
                "no answer from etcd within the lease TTL")

    def status(self) -> dict:
        """A JSON-able summary for ``/health``: lease, etcd reachability, registrations."""
        return {"node": self.node_name, "lease_id": self._lease_id,
                "lease_alive": self._lease_alive, "etcd_reachable": self._etcd_ok,
                "registrations": self.registrations, "ttl_seconds": self.ttl,
                "health": self._health.value}

    @property
    def tasks(self) -> list[Supervised]:
        """The supervised background tasks (keep-alive and sync), for ``/health``."""
        return [self._keepalive_task, self._sync_task]

    @property
    def interval(self) -> float:
        """Keep-alive period in seconds: ``ttl / 3`` (etcd's recommendation, see module doc)."""
        return self.ttl / 3

    @property
    def write_timeout(self) -> float:
        """The most any single etcd write (or lease grant/revoke) may take: ``ttl / 3``. One that
        takes longer counts as failed (and is retried), so no write holds the lock for long."""
        return self.ttl / 3

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Grant a lease, write the record and start the heartbeat task.

        Raises :class:`StoreError` if etcd can't be reached for the first registration."""
        self._capacity = await self._capacity_fn()
        self._health = self._health_fn()
        await self._register()
        self._keepalive_task.start()
        self._sync_task.start()

    async def stop(self, *, revoke: bool = True) -> None:
        """Stop heart-beating; with ``revoke`` (default) revoke the lease so the node record and
        every report disappear at once. Never raises for etcd trouble (logs it)."""
        self._stopping = True
        await self._keepalive_task.stop()
        await self._sync_task.stop()
        if revoke and self._lease_id is not None:
            try:
                async with self._lock:
                    await self._bounded(self._store.revoke_lease(self._lease_id), "revoke")
                log.info("revoked lease %x of node %s", self._lease_id, self.node_name)
            except StoreError as e:
                log.warning("could not revoke lease %x (its keys expire after %ss): %s",
                            self._lease_id, self.ttl, e)
        self._lease_alive = False

    # -- reports -----------------------------------------------------------------------------
    async def put_report(self, key: str, report: LeaseBound) -> None:
        """Record ``report`` (an assignment report, or a deployment's stats report) as the
        state of ``key`` and write it under the lease.

        Identical reports (ignoring ``updated_unix``) are not rewritten. Each write is bounded
        by :attr:`write_timeout`; if it fails or times out it is retried by the sync task; this
        method never raises for etcd trouble."""
        if _same_report(self._reports.get(key), report) and key not in self._dirty_reports:
            return
        self._reports[key] = report
        self._pending_deletes.discard(key)
        self._dirty_reports.add(key)
        await self._flush_reports()

    async def delete_report(self, key: str) -> None:
        """Forget ``key``'s report and delete it from etcd (retried on failure)."""
        self._reports.pop(key, None)
        self._dirty_reports.discard(key)
        self._pending_deletes.add(key)
        await self._flush_reports()

    def report(self, key: str) -> LeaseBound | None:
        """The latest report recorded for ``key`` (whether or not it reached etcd yet)."""
        return self._reports.get(key)

    async def _flush_reports(self) -> None:
        async with self._lock:
            if self._lease_id is None or not self._lease_alive:
                return  # re-registration writes everything
            # put_report/delete_report change the maps without the lock (they only wait for it
            # to write), so a flag is cleared only if nothing newer arrived during the write.
            try:
                for key in list(self._pending_deletes):
                    await self._bounded(self._store.delete(key), f"delete {key}")
                    if key not in self._reports:
                        self._pending_deletes.discard(key)
                for key in list(self._dirty_reports):
                    report = self._reports.get(key)
                    if report is not None:
                        await self._bounded(self._store.put(key, report.to_json(),
                                                            lease=self._lease_id), f"put {key}")
                    if self._reports.get(key) is report:
                        self._dirty_reports.discard(key)
                self._ok()
            except StoreError as e:
                self._etcd_ok = False
                log.warning("writing reports of node %s failed (retrying in %.1fs): %s",
                            self.node_name, self.interval, e)

    # -- internals ---------------------------------------------------------------------------
    async def _bounded(self, call: Coroutine[Any, Any, Any], what: str) -> Any:
        """Await one store call, at most :attr:`write_timeout`; a timeout is a StoreError.

        ``asyncio.timeout``, not ``asyncio.wait_for``: on Python 3.11 ``wait_for`` returns the
        result instead of raising when the call completes in the same loop iteration as a
        cancellation, so the cancelled task would carry on (and ``stop()`` of a supervised
        task blocked on it would hang)."""
        try:
            async with asyncio.timeout(self.write_timeout):
                return await call
        except TimeoutError:
            raise StoreError(f"{what}: no answer from etcd within "
                             f"{self.write_timeout:.1f}s") from None

    def _ok(self) -> None:
        self._etcd_ok = True
        self._last_ok = time.monotonic()

    def _record(self) -> NodeRecord:
        assert self._capacity is not None
        return NodeRecord(name=self.node_name, address=self.address, labels=self.labels,
                          capacity=self._capacity, health=self._health,
                          agent_version=self.agent_version,
                          serving_options=self.serving_options,
                          **({} if self.model_tasks is None else {"tasks": self.model_tasks}))

    async def _register(self) -> None:
        """Grant a new lease and (re)write the record and every report under it, atomically."""
        async with self._lock:
            old = self._lease_id
            lease = await self._bounded(self._store.grant_lease(self.ttl), "grant lease")
            record = self._record()
            reports = dict(self._reports)
            deletes = set(self._pending_deletes)
            ops: list[Put] = [Put(self.key, record.to_json(), lease=lease)]
            ops += [Put(k, r.to_json(), lease=lease) for k, r in reports.items()]
            try:
                for i in range(0, len(ops), _MAX_TXN_OPS):
                    await self._bounded(self._store.txn([], ops[i:i + _MAX_TXN_OPS]),
                                        "register")
                for key in deletes:
                    await self._bounded(self._store.delete(key), f"delete {key}")
            except StoreError:
                with contextlib.suppress(StoreError):
                    await self._bounded(self._store.revoke_lease(lease), "revoke")
                raise
            # Reports changed while we were writing stay dirty for the next flush.
            self._pending_deletes -= {k for k in deletes if k not in self._reports}
            self._dirty_reports -= {k for k, r in reports.items() if self._reports.get(k) is r}
            self._lease_id = lease
            self._lease_alive = True
            self._record_dirty = (record.health, record.capacity) != (self._health, self._capacity)
            self.registrations += 1
            self._ok()
            flush_again = bool(self._dirty_reports or self._pending_deletes)
        log.info("registered node %s (lease %x, ttl %ss, %d report(s)%s)", self.node_name, lease,
                 self.ttl, len(reports),
                 f", replacing lease {old:x}" if old is not None else "")
        if old is not None and old != lease:
            # The old lease may still be alive (a partition shorter than etcd noticed); it
            # holds no keys any more, so revoking it only tidies up.
            with contextlib.suppress(StoreError):
                await self._bounded(self._store.revoke_lease(old), "revoke")
        if flush_again:
            await self._flush_reports()

    async def _write_record_if_changed(self) -> None:
        health = self._health_fn()
        if health != self._health:
            self._health = health
            self._record_dirty = True
        cap = await self._capacity_fn()
        if materially_different(self._capacity, cap, available_threshold_bytes=self._threshold):
            self._capacity = cap
            self._record_dirty = True
        if not self._record_dirty:
            return
        async with self._lock:
            if self._lease_id is None or not self._lease_alive:
                return  # re-registration writes it
            record = self._record()
            await self._bounded(self._store.put(self.key, record.to_json(), lease=self._lease_id),
                                "put node record")
            self._record_dirty = (record.health, record.capacity) != (self._health, self._capacity)
            self._ok()
        log.info("updated node record of %s (health %s, available %d bytes)", self.node_name,
                 record.health.value, record.capacity.memory_available_bytes)

    # -- the keep-alive task: keep-alives and nothing else -------------------------------------
    async def _keepalive(self) -> None:
        """Send one keep-alive (bounded to ``ttl / 3``) and judge the lease by its answer. Never
        writes and never takes the lock; re-registration is left to the sync task."""
        lease = self._lease_id
        if lease is None or not self._lease_alive:
            return  # the sync task is re-registering
        try:
            # Bounded by the keep-alive period: a late answer is as good as none, and the next
            # keep-alive must go out on time (see the module doc).
            # (asyncio.timeout: see _bounded)
            async with asyncio.timeout(self.interval):
                remaining = await self._store.keepalive(lease)
        except (StoreError, asyncio.TimeoutError) as e:
            if isinstance(e, asyncio.TimeoutError):
                e = StoreError(f"no keep-alive answer within {self.interval:.1f}s")
            if lease != self._lease_id:
                return  # re-registered meanwhile: this answer is about the old lease
            self._etcd_ok = False
            down_for = time.monotonic() - self._last_ok
            if down_for > self.ttl:
                self._lease_alive = False
                self._wake.set()
                log.warning("etcd unreachable for %.1fs (> ttl %ss): lease %x presumed lost; "
                            "re-registering when etcd answers (%s)", down_for, self.ttl,
                            lease, e)
            else:
                log.warning("keep-alive of lease %x failed (%s); retrying", lease, e)
            return
        if lease != self._lease_id:
            return
        self._ok()
        if remaining <= 0:
            log.warning("lease %x of node %s expired or was revoked; re-registering",
                        lease, self.node_name)
            self._lease_alive = False
            self._wake.set()

    async def _keepalive_loop(self) -> None:
        """A keep-alive every ``ttl / 3`` on a fixed cadence until :meth:`stop`. etcd trouble is
        handled in :meth:`_keepalive`; anything else is a bug and ends the run, which
        :class:`Supervised` logs and restarts."""
        deadline = time.monotonic() + self.interval
        while not self._stopping:
            wait = deadline - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            await self._keepalive()
            deadline = next_deadline(deadline, self.interval, time.monotonic())

    # -- the sync task: (re-)registration, record and report writes ----------------------------
    async def _sync(self) -> None:
        """Re-register when the lease is gone; else rewrite the record if it changed and retry
        report writes that failed."""
        if not self._lease_alive or self._lease_id is None:
            await self._register()
            return
        await self._write_record_if_changed()
        if self._dirty_reports or self._pending_deletes:
            await self._flush_reports()

    async def _sync_loop(self) -> None:
        """Sync every ``ttl / 3``, and at once when woken (health change, lost lease), until
        :meth:`stop`. Its writes are bounded, and it never delays a keep-alive."""
        deadline = time.monotonic() + self.interval
        while not self._stopping:
            # An early wake leaves the cadence alone.
            scheduled = True
            wait = deadline - time.monotonic()
            if wait > 0:
                try:
                    async with asyncio.timeout(wait):  # not wait_for: see _bounded
                        await self._wake.wait()
                    scheduled = False
                except TimeoutError:
                    pass
            self._wake.clear()
            try:
                await self._sync()
            except StoreError as e:
                self._etcd_ok = False
                log.warning("registration of node %s: %s; retrying in %.1fs",
                            self.node_name, e, self.interval)
            if scheduled:
                deadline = next_deadline(deadline, self.interval, time.monotonic())
