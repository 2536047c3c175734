"""Typed views of an etcd prefix: follow it, parse each value, keep a dict, call back on change.

Two layers, used by the agent and the operator alike:

* :func:`follow_prefix` — the watch discipline of the contract, once: list, then watch from
  ``list revision + 1``; after a disconnect resume from the last revision seen; when that
  revision was compacted, re-list and hand the caller a fresh :class:`Snapshot`, so no event is
  ever silently skipped.
* :class:`PrefixView` — on top of it, the contract's typed records by key: each value parsed
  (:mod:`mlx_fleet.contract`'s ``from_json``), a malformed one logged and left out (never a
  crash), a re-listing diffed against what the view held so the caller hears only of real
  changes, and ``await view.wait_for(revision)`` instead of sleeping until a write shows.

No client here: the views run on any :class:`~mlx_fleet.store_api.Store` (the etcd one, or
:class:`~mlx_fleet.memstore.MemoryStore` in tests).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Generic, TypeVar

from mlx_fleet.store_api import KV, Compacted, Store, StoreError, WatchEvent

log = logging.getLogger(__name__)

K = TypeVar("K")
R = TypeVar("R")


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Every key under the prefix at ``revision``; replaces whatever the follower held."""

    items: list[KV]
    revision: int


async def follow_prefix(store: Store, prefix: str,
                        on_snapshot: Callable[[Snapshot], Awaitable[None]],
                        on_event: Callable[[WatchEvent], Awaitable[None]],
                        *, retry_delay: float = 0.5, max_retry_delay: float = 5.0) -> None:
    """Keep a caller's view of ``prefix`` exact, forever (until cancelled).

    1. list the prefix → ``on_snapshot``; 2. watch from ``snapshot.revision + 1`` → ``on_event``
    for each change; 3. if the stream breaks, resume from ``last seen revision + 1`` (after a
    capped exponential back-off, ``retry_delay`` doubling to ``max_retry_delay`` seconds);
    4. if that revision was compacted, go back to 1.
    Errors raised by the callbacks propagate (they are bugs, not transport failures).
    """
    next_rev: int | None = None
    delay = retry_delay
    while True:
        try:
            if next_rev is None:
                snap = await store.list(prefix)
                await on_snapshot(Snapshot(items=snap.items, revision=snap.revision))
                next_rev = snap.revision + 1
            async for ev in store.watch(prefix, next_rev):
                await on_event(ev)
                next_rev = ev.kv.mod_revision + 1
                delay = retry_delay
        except Compacted as e:
            log.warning("watch on %s: %s; re-listing", prefix, e)
            next_rev = None
            continue
        except StoreError as e:
            log.warning("watch on %s broke (%s); resuming from revision %s in %.1fs",
                        prefix, e, next_rev, delay)
        await asyncio.sleep(delay)
        delay = min(delay * 2, max_retry_delay)


@dataclasses.dataclass(frozen=True)
class Change(Generic[K, R]):
    """One key's record as the view had it (``old``) and has it now (``new``); None: absent
    (never written, deleted, or malformed). ``kv``: the write behind ``new`` (None when gone)."""

    key: K
    old: R | None
    new: R | None
    kv: KV | None


@dataclasses.dataclass(frozen=True)
class ViewUpdate(Generic[K, R]):
    """What one step of the view changed: ``changes`` (possibly none, for a re-listing that
    found everything as it was), at store ``revision``; ``listing``: the step was a (re-)listing
    (the first one, or one after a compaction), not a watch event."""

    changes: tuple[Change[K, R], ...]
    revision: int
    listing: bool


class PrefixView(Generic[K, R]):
    """The records under ``prefix``, typed and kept current: ``items`` maps each key (as
    ``parse_key`` reads it) to its record (as ``parse_value`` reads the value).

    ``parse_key(key) -> K | None``: the typed key of a stored key (e.g.
    :meth:`~mlx_fleet.contract.Keys.parse_traffic`); None for a key outside the layout, which is
    logged and ignored. ``parse_value(key, value) -> R``: the record (e.g.
    ``lambda k, v: TrafficSplit.from_json(v)``); a ``ValueError`` (pydantic's ``ValidationError``
    is one) means malformed: logged, and the key is treated as absent until a valid value is
    written. ``on_change(update)``: called (and awaited when it returns an awaitable) after each
    step that changed a record — a watch event, or a (re-)listing: a listing is diffed against
    what the view held by each key's ``mod_revision``, so only keys written, deleted or newly
    malformed since are reported; the first listing is always reported (``listing=True``),
    even when empty. Errors raised by ``on_change`` propagate out of :meth:`run` (bugs).

    ``name``: for log lines (default: the prefix). Run :meth:`run` in a supervised task; read
    ``items``/``revision`` from the same event loop.
    """

    def __init__(self, store: Store, prefix: str, *, parse_key: Callable[[str], K | None],
                 parse_value: Callable[[K, bytes], R],
                 on_change: Callable[[ViewUpdate[K, R]], Awaitable[None] | None] | None = None,
                 name: str | None = None) -> None:
        self._store = store
        self.prefix = prefix
        self._parse_key = parse_key
        self._parse_value = parse_value
        self._on_change = on_change
        self.name = name or prefix
        self.items: dict[K, R] = {}
        #: The write behind each record of ``items``.
        self.kvs: dict[K, KV] = {}
        #: The latest store revision the view has applied (a listing's, or an event's).
        self.revision = 0
        #: How many (re-)listings the view has applied (1 after the first).
        self.listings = 0
        #: Set once the first listing is applied (and ``on_change`` has run on it).
        self.synced = asyncio.Event()
        self._stepped = asyncio.Event()

    # -- driving ----------------------------------------------------------------------------------

    async def run(self, *, retry_delay: float = 0.5, max_retry_delay: float = 5.0) -> None:
        """Follow the prefix forever (:func:`follow_prefix`); cancel to stop."""
        await follow_prefix(self._store, self.prefix, self.apply_snapshot, self.apply_event,
                            retry_delay=retry_delay, max_retry_delay=max_retry_delay)

    async def apply_snapshot(self, snap: Snapshot) -> None:
        """Replace the view with a listing (what :meth:`run` does on each (re-)listing)."""
        fresh: dict[K, tuple[KV, R]] = {}
        changes: list[Change[K, R]] = []
        for kv in snap.items:
            key = self._key(kv.key)
            if key is None:
                continue
            held = self.kvs.get(key)
            if held is not None and held.mod_revision == kv.mod_revision:
                fresh[key] = (held, self.items[key])  # unchanged since we read it
                continue
            record = self._record(key, kv)
            if record is not None:
                fresh[key] = (kv, record)
            if record is not None or key in self.items:
                changes.append(Change(key, self.items.get(key), record,
                                      kv if record is not None else None))
        changes += [Change(key, self.items[key], None, None)
                    for key in self.items if key not in fresh]
        self.items = {k: r for k, (_, r) in fresh.items()}
        self.kvs = {k: kv for k, (kv, _) in fresh.items()}
        self.listings += 1
        first = not self.synced.is_set()
        await self._stepped_to(snap.revision, changes, listing=True, always=first)
        self.synced.set()  # after the callback: a waiter sees the caller's state too

    async def apply_event(self, ev: WatchEvent) -> None:
        """Apply one watch event (what :meth:`run` does for each)."""
        key = self._key(ev.kv.key)
        change: list[Change[K, R]] = []
        if key is not None:
            old = self.items.get(key)
            record = self._record(key, ev.kv) if ev.type == "PUT" else None
            if record is None:
                self.items.pop(key, None)
                self.kvs.pop(key, None)
            else:
                self.items[key] = record
                self.kvs[key] = ev.kv
            if record is not None or old is not None:
                change.append(Change(key, old, record, ev.kv if record is not None else None))
        await self._stepped_to(ev.kv.mod_revision, change, listing=False)

    # -- waiting ----------------------------------------------------------------------------------

    async def wait_for(self, revision: int) -> None:
        """Return once the view has applied a step at store ``revision`` or later: a write
        under the prefix that committed at ``revision`` is then reflected. (The events of one
        transaction share its revision and arrive one by one: after a multi-key transaction,
        wait with :meth:`wait_until` for the key that matters.) A revision whose writes are
        all outside the prefix is only passed by a later write inside it."""
        while self.revision < revision:
            await self._next_step()

    async def wait_until(self, predicate: Callable[[Mapping[K, R]], bool]) -> None:
        """Return once ``predicate(items)`` holds (checked now and after every step)."""
        while not predicate(self.items):
            await self._next_step()

    # -- internals --------------------------------------------------------------------------------

    def _key(self, raw: str) -> K | None:
        key = self._parse_key(raw)
        if key is None:
            log.warning("view %s: ignoring key %s (outside the key layout)", self.name, raw)
        return key

    def _record(self, key: K, kv: KV) -> R | None:
        try:
            return self._parse_value(key, kv.value)
        except ValueError as e:
            log.error("view %s: ignoring malformed record %s (revision %d): %s", self.name,
                      kv.key, kv.mod_revision, str(e).replace("\n", "; "))
            return None

    async def _stepped_to(self, revision: int, changes: list[Change[K, R]], *, listing: bool,
                          always: bool = False) -> None:
        self.revision = max(self.revision, revision)
        if self._on_change is not None and (changes or always):
            result = self._on_change(ViewUpdate(tuple(changes), revision, listing))
            if inspect.isawaitable(result):
                await result
        stepped, self._stepped = self._stepped, asyncio.Event()
        stepped.set()

    async def _next_step(self) -> None:
        await self._stepped.wait()
