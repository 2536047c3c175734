"""An in-memory :class:`~mlx_fleet.store.Store`: etcd's data model without etcd.

:class:`MemoryStore` keeps what callers of :class:`~mlx_fleet.store.EtcdStore` rely on, with
etcd's rules (etcd API reference, ``api/v3/etcdserverpb/rpc.proto`` and ``mvcc/``), so logic
can be tested without a server: one global revision (1 in a fresh store, +1 per write that
changed something; every operation of one transaction shares it), per-key ``create_revision``
/ ``mod_revision`` / ``version``, transactions guarded by :class:`~mlx_fleet.store.Compare`,
prefix watches that replay history from a start revision and then stream live events,
compaction (a watch starting below it raises :class:`~mlx_fleet.store.Compacted`), and leases
whose keys are deleted — with delete events, in one revision — when they are revoked or expire.

Lease expiry runs on an injected ``clock`` (seconds, monotonic). By default a reaper task
expires leases in real time, as etcd does; a test that wants to decide when a lease dies passes
``auto_expire=False`` (and, to drive deadlines, a fake ``clock``) and calls
:meth:`MemoryStore.expire_due` or :meth:`MemoryStore.expire_lease` — no sleeping.

No gRPC, no aetcd: importable wherever :mod:`mlx_fleet.store` is. Everything a method does
happens at once, after one yield to the event loop (an RPC's await point), so each operation is
atomic with respect to the others, as etcd's are.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence

from mlx_fleet.store_api import KV, Compacted, Compare, Delete, Listing, Put, StoreError, WatchEvent
from mlx_fleet.supervise import wait_event

MIN_LEASE_TTL_SECONDS = 2
"""etcd raises a granted TTL below this to it (``lease.Lessor``'s ``minLeaseTTL`` =
⌈3/2 × election ticks × heartbeat⌉ = ⌈1.5 × 10 × 0.1 s⌉ with etcd's default
``--heartbeat-interval=100`` and ``--election-timeout=1000``)."""


@dataclasses.dataclass
class _Lease:
    id: int
    ttl: int
    deadline: float
    keys: set[str] = dataclasses.field(default_factory=set)


class _Watch:
    """One live watch: the events it has yet to yield, and an error to end it with."""

    def __init__(self, prefix: str, start_revision: int) -> None:
        self.prefix = prefix
        self.start_revision = start_revision
        #: None ends the watch; a StoreError ends it with that error.
        self.queue: asyncio.Queue[WatchEvent | StoreError | None] = asyncio.Queue()


class MemoryStore:
    """:class:`~mlx_fleet.store.Store` in memory, behaving like :class:`EtcdStore` on a
    one-member etcd.

    ``clock``: monotonic seconds for lease deadlines (default :func:`time.monotonic`).
    ``auto_expire``: expire leases when their deadline passes, from a task of the running
    event loop (the default, like etcd); off, leases die only through :meth:`expire_due`,
    :meth:`expire_lease` or :meth:`revoke_lease`.

    Errors mirror etcd's: a write naming a lease that does not exist, an empty key, a
    compaction of a future or already compacted revision and any call after :meth:`close`
    raise :class:`StoreError`; a watch from a compacted revision raises :class:`Compacted`.
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic,
                 auto_expire: bool = True) -> None:
        self.endpoint = "memory://"
        self._clock = clock
        self._auto_expire = auto_expire
        self._revision = 1  # a fresh etcd answers revision 1
        self._compact_revision = 0
        self._kvs: dict[str, KV] = {}
        self._history: list[WatchEvent] = []  # events from the compact revision on, in order
        self._watches: set[_Watch] = set()
        self._leases: dict[int, _Lease] = {}
        self._lease_ids = itertools.count(0x694D_0000_0001)  # etcd's are opaque int64s
        self._reaper: asyncio.Task[None] | None = None
        self._deadline_changed = asyncio.Event()
        self._closed = False

    async def __aenter__(self) -> MemoryStore:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        """Nothing to connect to; raises :class:`StoreError` after :meth:`close`."""
        await self._enter()

    async def close(self) -> None:
        """End every live watch (quietly, as aetcd's do when their client closes) and stop
        the lease reaper; later calls raise :class:`StoreError`."""
        self._closed = True
        for w in self._watches:
            w.queue.put_nowait(None)
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None

    @property
    def revision(self) -> int:
        """The current store revision (what ``list`` would report)."""
        return self._revision

    # -- reads ----------------------------------------------------------------------------------

    async def get(self, key: str) -> KV | None:
        await self._enter()
        return self._kvs.get(key)

    async def list(self, prefix: str) -> Listing:
        """Every key starting with ``prefix``, sorted by key (etcd orders by the key's bytes;
        UTF-8 keeps code-point order), at the current revision."""
        await self._enter()
        return Listing(items=[self._kvs[k] for k in sorted(self._kvs) if k.startswith(prefix)],
                       revision=self._revision)

    # -- writes ---------------------------------------------------------------------------------

    async def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        """Unconditional put; returns the new store revision. A put without ``lease``
        detaches the key from any lease it had (etcd's ``PutRequest`` semantics)."""
        await self._enter()
        self._check_ops([Put(key, value, lease)])
        return self._commit([Put(key, value, lease)])

    async def delete(self, key: str) -> bool:
        """Delete ``key``; False when it did not exist (then the revision does not move)."""
        await self._enter()
        existed = key in self._kvs
        self._commit([Delete(key)])
        return existed

    async def txn(self, compares: Sequence[Compare], success: Sequence[Put | Delete],
                  failure: Sequence[Put | Delete] = ()) -> int:
        """Apply ``success`` atomically if every compare holds (else ``failure``), like
        :meth:`EtcdStore.txn <mlx_fleet.store.EtcdStore.txn>`: returns the revision the
        transaction committed at when the compares held (the current one when it changed
        nothing), 0 when they failed. Compares follow etcd's ``applyCompare``: a missing key
        has mod/create revision and version 0, and a ``value`` compare on a missing key is
        false whatever the operator."""
        await self._enter()
        ok = all(self._holds(c) for c in compares)
        ops = success if ok else failure
        self._check_ops(ops)
        revision = self._commit(ops)
        return revision if ok else 0

    async def compact(self, revision: int) -> None:
        """Forget history before ``revision`` (etcd's ``Compact``): a watch from a revision
        below it raises :class:`Compacted`. Raises :class:`StoreError` for a future revision
        or one at or below the last compaction (etcd: ``mvcc: required revision is a future
        revision`` / ``... has been compacted``)."""
        await self._enter()
        if revision > self._revision:
            raise StoreError(f"memory store: compact {revision}: required revision is a "
                             f"future revision (current {self._revision})")
        if revision <= self._compact_revision:
            raise StoreError(f"memory store: compact {revision}: required revision has been "
                             f"compacted (at {self._compact_revision})")
        self._compact_revision = revision
        self._history = [e for e in self._history if e.kv.mod_revision >= revision]

    # -- watches --------------------------------------------------------------------------------

    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[WatchEvent]:
        """Yield every change under ``prefix`` from ``start_revision`` (inclusive) on: first the
        history still held, then live events, in revision order (a transaction's events in
        its operations' order). ``start_revision`` 0: from the next revision on (etcd's
        default).

        Raises :class:`Compacted` if ``start_revision`` is below the last compaction (etcd
        refuses ``minRev < compactRev``), :class:`StoreError` when :meth:`break_watches` is
        called; ends when the store is closed. Like etcd's, the watch starts when first
        iterated."""
        await self._enter()
        if start_revision <= 0:  # etcd: no start revision means "from now on"
            start_revision = self._revision + 1
        if start_revision < self._compact_revision:
            raise Compacted(self._compact_revision)
        w = _Watch(prefix, start_revision)
        for e in self._history:  # replay, then live: registered in the same step, no gap
            if e.kv.mod_revision >= start_revision and e.kv.key.startswith(prefix):
                w.queue.put_nowait(e)
        self._watches.add(w)
        try:
            while True:
                item = await w.queue.get()
                if item is None:
                    return
                if isinstance(item, StoreError):
                    raise item
                yield item
        finally:
            self._watches.discard(w)

    def break_watches(self, reason: str = "connection cut") -> int:
        """End every live watch with :class:`StoreError` (a broken stream, for tests of the
        resume path); returns how many were ended."""
        for w in self._watches:
            w.queue.put_nowait(StoreError(f"memory store watch: {reason}"))
        return len(self._watches)

    # -- leases ---------------------------------------------------------------------------------

    async def grant_lease(self, ttl_seconds: int) -> int:
        """A new lease of ``ttl_seconds`` (at least :data:`MIN_LEASE_TTL_SECONDS`, as etcd);
        returns its ID."""
        await self._enter()
        ttl = max(int(ttl_seconds), MIN_LEASE_TTL_SECONDS)
        lease = _Lease(id=next(self._lease_ids), ttl=ttl, deadline=self._clock() + ttl)
        self._leases[lease.id] = lease
        self._schedule()
        return lease.id

    async def keepalive(self, lease_id: int) -> int:
        """Refresh the lease to its full TTL; returns that TTL in seconds, or 0 when the lease
        expired or was revoked (etcd's ``LeaseKeepAliveResponse`` with TTL 0)."""
        await self._enter()
        lease = self._leases.get(lease_id)
        if lease is None:
            return 0
        lease.deadline = self._clock() + lease.ttl
        self._schedule()
        return lease.ttl

    async def time_to_live(self, lease_id: int) -> int:
        """Seconds left on the lease (rounded down, etcd's ``LeaseTimeToLive``), -1 when it
        does not exist."""
        await self._enter()
        lease = self._leases.get(lease_id)
        return -1 if lease is None else max(0, int(lease.deadline - self._clock()))

    async def revoke_lease(self, lease_id: int) -> None:
        """Delete the lease and its keys (one revision, a delete event per key). Raises
        :class:`StoreError` for an unknown lease (etcd: ``requested lease not found``)."""
        await self._enter()
        if lease_id not in self._leases:
            raise StoreError(f"memory store: revoke {lease_id:x}: requested lease not found")
        self._drop_lease(lease_id)

    def expire_lease(self, lease_id: int) -> bool:
        """Let the lease expire now, as if its TTL passed without a keep-alive: its keys go,
        with delete events. Returns False when it does not exist."""
        if lease_id not in self._leases:
            return False
        self._drop_lease(lease_id)
        return True

    def expire_due(self) -> list[int]:
        """Expire every lease whose deadline is at or before ``clock()``; returns their IDs
        (what the reaper does, for tests with ``auto_expire=False`` and a fake clock)."""
        now = self._clock()
        due = sorted(i for i, lease in self._leases.items() if lease.deadline <= now)
        for i in due:
            self._drop_lease(i)
        return due

    # -- internals ------------------------------------------------------------------------------

    async def _enter(self) -> None:
        if self._closed:
            raise StoreError("memory store closed")
        await asyncio.sleep(0)  # an RPC's await point: other tasks run here, as with etcd
        if self._closed:
            raise StoreError("memory store closed")

    def _holds(self, c: Compare) -> bool:
        kv = self._kvs.get(c.key)
        if c.target == "value":
            if kv is None:
                return False  # etcd: a value compare on a missing key always fails
            have: int | bytes = kv.value
        elif kv is None:
            have = 0
        else:
            have = {"mod": kv.mod_revision, "create": kv.create_revision,
                    "version": kv.version}[c.target]
        want = c.value
        if isinstance(have, bytes) != isinstance(want, bytes):
            raise StoreError(f"memory store: compare {c.target} of {c.key!r} with "
                             f"{type(want).__name__}")
        if c.op == "==":
            return have == want
        if c.op == "!=":
            return have != want
        if c.op == "<":
            return have < want  # type: ignore[operator]
        return have > want  # type: ignore[operator]

    def _check_ops(self, ops: Iterable[Put | Delete]) -> None:
        for op in ops:
            if not op.key:
                raise StoreError("memory store: key is not provided")
            if isinstance(op, Put) and op.lease and op.lease not in self._leases:
                raise StoreError(f"memory store: put {op.key!r}: requested lease not found")

    def _commit(self, ops: Sequence[Put | Delete]) -> int:
        """Apply ``ops`` at one new revision (none when nothing changes); notify watches."""
        rev = self._revision + 1
        events: list[WatchEvent] = []
        for op in ops:
            old = self._kvs.get(op.key)
            if old is not None and old.lease in self._leases:
                self._leases[old.lease].keys.discard(op.key)
            if isinstance(op, Put):
                lease = op.lease or 0
                kv = KV(key=op.key, value=bytes(op.value), mod_revision=rev,
                        create_revision=old.create_revision if old else rev,
                        version=old.version + 1 if old else 1, lease=lease)
                self._kvs[op.key] = kv
                if lease:
                    self._leases[lease].keys.add(op.key)
                events.append(WatchEvent("PUT", kv))
            elif old is not None:
                del self._kvs[op.key]
                events.append(WatchEvent("DELETE", KV(key=op.key, value=b"", mod_revision=rev)))
        if not events:
            return self._revision
        self._revision = rev
        self._history.extend(events)
        for w in self._watches:
            for e in events:
                if e.kv.mod_revision >= w.start_revision and e.kv.key.startswith(w.prefix):
                    w.queue.put_nowait(e)
        return rev

    def _drop_lease(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id)
        self._commit([Delete(k) for k in sorted(lease.keys)])
        self._deadline_changed.set()

    def _schedule(self) -> None:
        """Start the reaper (auto-expiry) or tell it a deadline moved."""
        if not self._auto_expire or self._closed:
            return
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap())
        self._deadline_changed.set()

    async def _reap(self) -> None:
        """Expire leases when their deadline passes, until no lease is left."""
        while self._leases:
            self._deadline_changed.clear()
            self.expire_due()
            if not self._leases:
                break
            wait = min(lease.deadline for lease in self._leases.values()) - self._clock()
            await wait_event(self._deadline_changed, max(wait, 0.0))
