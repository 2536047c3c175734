"""The Store contract: every test runs on the real etcd (``EtcdStore``) and on ``MemoryStore``.

Whatever callers rely on — revisions, fenced transactions, watches from a revision, prefix
isolation, leases whose keys vanish with delete events, compaction — is pinned here once, so the
in-memory store cannot drift from etcd. etcd is shared by the session: each test works under its
own key root (``keys``) and asserts revisions relative to what it read.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from mlx_fleet.contract import Keys
from mlx_fleet.memstore import MemoryStore
from mlx_fleet.store import (
    Compacted,
    Compare,
    Delete,
    EtcdStore,
    Put,
    Snapshot,
    Store,
    StoreError,
    WatchEvent,
    follow_prefix,
)

AnyStore = EtcdStore | MemoryStore


async def collect(store: Store, prefix: str, start: int, n: int) -> list[WatchEvent]:
    """The first ``n`` events of a watch on ``prefix`` from ``start`` (10 s at most)."""
    seen: list[WatchEvent] = []
    async with asyncio.timeout(10):
        async for ev in store.watch(prefix, start):
            seen.append(ev)
            if len(seen) == n:
                break
    return seen


def summary(events: list[WatchEvent]) -> list[tuple[str, str, bytes]]:
    return [(e.type, e.kv.key, e.kv.value) for e in events]


async def test_writes_move_one_revision_and_keep_key_metadata(any_store: AnyStore,
                                                              keys: Keys) -> None:
    key = keys.node("a")
    r1 = await any_store.put(key, b"1")
    first = await any_store.get(key)
    assert first is not None and (first.mod_revision, first.create_revision, first.version,
                                  first.lease) == (r1, r1, 1, 0)
    r2 = await any_store.put(key, b"2")
    second = await any_store.get(key)
    assert r2 > r1 and (second.mod_revision, second.create_revision, second.version) == (r2, r1, 2)
    # A delete of a key that is not there changes nothing, not even the revision.
    before = (await any_store.list(keys.nodes_prefix)).revision
    assert await any_store.delete(keys.node("missing")) is False
    assert (await any_store.list(keys.nodes_prefix)).revision == before
    assert await any_store.delete(key) is True
    assert await any_store.get(key) is None
    # Re-created: a new life, counted from scratch.
    r3 = await any_store.put(key, b"3")
    third = await any_store.get(key)
    assert (third.create_revision, third.version) == (r3, 1)


async def test_txn_is_fenced_on_mod_revision(any_store: AnyStore, keys: Keys) -> None:
    store = any_store
    key = keys.placement_epoch
    # absent → created; the result is the revision it committed at
    created = await store.txn([Compare(key, "mod", "==", 0)], [Put(key, b"1")])
    first = await store.get(key)
    assert first is not None and first.value == b"1" and created == first.mod_revision
    # A writer that read before `first` loses and changes nothing.
    assert await store.txn([Compare(key, "mod", "==", 0)], [Put(key, b"stale")]) == 0
    assert (await store.get(key)).value == b"1"
    # The writer that read `first` wins (a delete and a put: one revision for both).
    other = keys.node("n")
    await store.put(other, b"x")
    won = await store.txn([Compare(key, "mod", "==", first.mod_revision)],
                          [Delete(other), Put(key, b"2")])
    second = await store.get(key)
    assert second.value == b"2" and won == second.mod_revision > first.mod_revision
    assert await store.get(other) is None


@pytest.mark.parametrize(("compare", "holds"), [
    (lambda k, kv: Compare(k, "version", "==", 2), True),
    (lambda k, kv: Compare(k, "version", ">", 2), False),
    (lambda k, kv: Compare(k, "version", "<", 3), True),
    (lambda k, kv: Compare(k, "create", "==", kv.create_revision), True),
    (lambda k, kv: Compare(k, "create", "!=", kv.create_revision), False),
    (lambda k, kv: Compare(k, "mod", ">", kv.create_revision), True),
    (lambda k, kv: Compare(k, "value", "==", b"v2"), True),
    (lambda k, kv: Compare(k, "value", "!=", b"v2"), False),
    (lambda k, kv: Compare(k, "value", ">", b"v1"), True),
    (lambda k, kv: Compare(k, "value", "<", b"v1"), False),
    # a key that does not exist: revisions and version 0, a value compare always false
    (lambda k, kv: Compare(k + "-absent", "version", "==", 0), True),
    (lambda k, kv: Compare(k + "-absent", "create", "==", 0), True),
    (lambda k, kv: Compare(k + "-absent", "value", "==", b""), False),
    (lambda k, kv: Compare(k + "-absent", "value", "!=", b"x"), False),
])
async def test_txn_compares_choose_success_or_failure(any_store: AnyStore, keys: Keys,
                                                      compare, holds: bool) -> None:
    key = keys.node("c")
    await any_store.put(key, b"v1")
    await any_store.put(key, b"v2")
    kv = await any_store.get(key)
    then, otherwise = keys.node("then"), keys.node("else")
    result = await any_store.txn([compare(key, kv)], [Put(then, b"1")], [Put(otherwise, b"1")])
    assert (result > 0) == holds
    assert (await any_store.get(then) is not None) == holds
    assert (await any_store.get(otherwise) is not None) == (not holds)


async def test_txn_without_writes_reports_the_current_revision(any_store: AnyStore,
                                                               keys: Keys) -> None:
    now = await any_store.put(keys.node("a"), b"1")
    assert await any_store.txn([Compare(keys.node("a"), "mod", "==", now)], []) >= now
    assert await any_store.txn([Compare(keys.node("a"), "mod", "!=", now)], []) == 0


async def test_list_reports_revision_and_sorted_items(any_store: AnyStore, keys: Keys) -> None:
    for name in ("b", "a", "c"):
        await any_store.put(keys.node(name), name.encode())
    listing = await any_store.list(keys.nodes_prefix)
    assert [kv.key for kv in listing.items] == [keys.node(n) for n in "abc"]
    assert listing.revision >= max(kv.mod_revision for kv in listing.items)


async def test_prefixes_are_isolated(any_store: AnyStore, keys: Keys) -> None:
    """A key that merely shares leading characters with the prefix's parent stays out of
    lists and watches of the prefix."""
    start = (await any_store.list(keys.nodes_prefix)).revision + 1
    inside = keys.nodes_prefix + "a"
    sibling = keys.nodes_prefix.rstrip("/") + "-other/a"
    await any_store.put(sibling, b"no")
    await any_store.put(inside, b"yes")
    assert [kv.key for kv in (await any_store.list(keys.nodes_prefix)).items] == [inside]
    assert summary(await collect(any_store, keys.nodes_prefix, start, 1)) == [
        ("PUT", inside, b"yes")]


async def test_watch_replays_from_a_revision_then_streams_live(any_store: AnyStore,
                                                               keys: Keys) -> None:
    prefix = keys.nodes_prefix
    r1 = await any_store.put(keys.node("a"), b"1")
    await any_store.put(keys.node("b"), b"2")
    await any_store.txn([], [Delete(keys.node("a")), Put(keys.node("c"), b"3")])
    seen: list[WatchEvent] = []
    got = asyncio.Event()

    async def consume() -> None:
        async for ev in any_store.watch(prefix, r1 + 1):  # history after the first put
            seen.append(ev)
            got.set()

    consumer = asyncio.create_task(consume())
    try:
        async with asyncio.timeout(10):
            while len(seen) < 3:
                got.clear()
                await got.wait()
        assert summary(seen) == [("PUT", keys.node("b"), b"2"), ("DELETE", keys.node("a"), b""),
                                 ("PUT", keys.node("c"), b"3")]
        assert seen[1].kv.mod_revision == seen[2].kv.mod_revision  # one transaction
        live = await any_store.put(keys.node("b"), b"22")
        async with asyncio.timeout(10):
            while len(seen) < 4:
                got.clear()
                await got.wait()
        assert summary(seen[3:]) == [("PUT", keys.node("b"), b"22")]
        assert (seen[3].kv.mod_revision, seen[3].kv.version) == (live, 2)
    finally:
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)


async def test_a_watch_from_revision_zero_starts_now(any_store: AnyStore, keys: Keys) -> None:
    """Revision 0: no history, only what is written once the watch exists (when that is, a
    caller cannot know: the test writes until the watch has seen a write)."""
    old = await any_store.put(keys.node("old"), b"1")
    seen: list[WatchEvent] = []

    async def consume() -> None:
        async for ev in any_store.watch(keys.nodes_prefix, 0):
            seen.append(ev)
            return

    consumer = asyncio.create_task(consume())
    async with asyncio.timeout(10):
        while not consumer.done():
            await any_store.put(keys.node("new"), b"2")
            await asyncio.wait({consumer}, timeout=0.05)
    assert summary(seen) == [("PUT", keys.node("new"), b"2")] and seen[0].kv.mod_revision > old


async def test_lease_revocation_deletes_attached_keys(any_store: AnyStore, keys: Keys) -> None:
    store = any_store
    lease = await store.grant_lease(30)
    assert await store.keepalive(lease) > 0
    assert 0 < await store.time_to_live(lease) <= 30
    r = await store.put(keys.node("leased"), b"x", lease=lease)
    await store.put(keys.node("leased-too"), b"y", lease=lease)
    await store.put(keys.node("kept"), b"z")
    assert (await store.get(keys.node("leased"))).lease == lease
    await store.revoke_lease(lease)
    assert await store.get(keys.node("leased")) is None
    assert [kv.key for kv in (await store.list(keys.nodes_prefix)).items] == [keys.node("kept")]
    events = await collect(store, keys.nodes_prefix, r, 5)
    deletes = events[3:]
    assert {(e.type, e.kv.key) for e in deletes} == {("DELETE", keys.node("leased")),
                                                     ("DELETE", keys.node("leased-too"))}
    assert deletes[0].kv.mod_revision == deletes[1].kv.mod_revision  # one revision
    # The lease is gone: a keep-alive finds nothing, a write naming it is refused.
    assert await store.keepalive(lease) <= 0
    assert await store.time_to_live(lease) == -1
    with pytest.raises(StoreError):
        await store.put(keys.node("late"), b"x", lease=lease)
    with pytest.raises(StoreError):
        await store.revoke_lease(lease)


async def test_a_put_without_the_lease_detaches_the_key(any_store: AnyStore, keys: Keys) -> None:
    lease = await any_store.grant_lease(30)
    await any_store.put(keys.node("a"), b"1", lease=lease)
    await any_store.put(keys.node("a"), b"2")
    assert (await any_store.get(keys.node("a"))).lease == 0
    await any_store.revoke_lease(lease)
    assert (await any_store.get(keys.node("a"))).value == b"2"


async def test_a_write_naming_an_unknown_lease_changes_nothing(any_store: AnyStore,
                                                               keys: Keys) -> None:
    lease = await any_store.grant_lease(30)
    await any_store.revoke_lease(lease)
    before = (await any_store.list(keys.nodes_prefix)).revision
    with pytest.raises(StoreError):  # the whole transaction is refused, not half applied
        await any_store.txn([], [Put(keys.node("a"), b"1"), Put(keys.node("b"), b"2", lease=lease)])
    assert (await any_store.list(keys.nodes_prefix)).items == []
    assert (await any_store.list(keys.nodes_prefix)).revision == before


async def test_a_key_deleted_before_its_lease_ends_is_deleted_once(any_store: AnyStore,
                                                                   keys: Keys) -> None:
    lease = await any_store.grant_lease(30)
    r = await any_store.put(keys.node("a"), b"1", lease=lease)
    await any_store.put(keys.node("b"), b"2", lease=lease)
    await any_store.delete(keys.node("a"))
    await any_store.revoke_lease(lease)
    sentinel = await any_store.put(keys.node("z"), b"end")
    events = await collect(any_store, keys.nodes_prefix, r, 5)
    assert [(e.type, e.kv.key) for e in events] == [
        ("PUT", keys.node("a")), ("PUT", keys.node("b")), ("DELETE", keys.node("a")),
        ("DELETE", keys.node("b")), ("PUT", keys.node("z"))]
    assert events[-1].kv.mod_revision == sentinel


async def test_lease_expiry_deletes_attached_keys(any_store: AnyStore, keys: Keys) -> None:
    """Without keep-alives the lease expires (etcd: after its TTL; the memory store: when the
    test says so) and its keys go with delete events."""
    lease = await any_store.grant_lease(2)
    r = await any_store.put(keys.node("leased"), b"x", lease=lease)
    if isinstance(any_store, MemoryStore):
        assert any_store.expire_lease(lease)
    events = await collect(any_store, keys.nodes_prefix, r, 2)  # etcd: within a few seconds
    assert summary(events) == [("PUT", keys.node("leased"), b"x"),
                               ("DELETE", keys.node("leased"), b"")]
    assert await any_store.get(keys.node("leased")) is None
    assert await any_store.keepalive(lease) <= 0


async def test_compaction_refuses_older_watches(any_store: AnyStore, keys: Keys) -> None:
    start = (await any_store.list(keys.nodes_prefix)).revision + 1
    await any_store.put(keys.node("w1"), b"1")
    await any_store.txn([], [Delete(keys.node("w1"))])
    assert [(e.type, e.kv.key) for e in await collect(any_store, keys.nodes_prefix, start, 2)] == [
        ("PUT", keys.node("w1")), ("DELETE", keys.node("w1"))]

    now = await any_store.put(keys.node("w2"), b"2")
    await any_store.compact(now)
    with pytest.raises(Compacted) as e:
        async for _ in any_store.watch(keys.nodes_prefix, start):
            pass
    assert e.value.compact_revision >= now
    # From the compaction revision on, history is still there.
    assert summary(await collect(any_store, keys.nodes_prefix, now, 1)) == [
        ("PUT", keys.node("w2"), b"2")]
    with pytest.raises(StoreError, match="compacted"):  # already compacted
        await any_store.compact(now)
    with pytest.raises(StoreError):  # a future revision
        await any_store.compact(now + 1_000_000)


class CuttableStore:
    """Delegates to a real store; the test can break the follower's watch stream (as a network
    cut would) and hold the reconnect until it has compacted the store behind the follower's
    back."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.cut_next_event = False
        self.cut_done = asyncio.Event()
        self.reconnect = asyncio.Event()
        self.reconnect.set()
        self.watch_starts: list[int] = []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[WatchEvent]:
        await self.reconnect.wait()
        self.watch_starts.append(start_revision)
        async for ev in self.inner.watch(prefix, start_revision):
            if self.cut_next_event:
                self.cut_next_event = False
                self.reconnect.clear()
                self.cut_done.set()
                raise StoreError("connection cut by the test")
            yield ev


async def test_follow_prefix_resumes_then_relists_after_compaction(any_store: AnyStore,
                                                                   keys: Keys) -> None:
    store = any_store
    view: dict[str, bytes] = {}
    snapshots: list[int] = []
    changed = asyncio.Event()

    async def on_snapshot(s: Snapshot) -> None:
        view.clear()
        view.update({kv.key: kv.value for kv in s.items})
        snapshots.append(s.revision)
        changed.set()

    async def on_event(e: WatchEvent) -> None:
        if e.type == "PUT":
            view[e.kv.key] = e.kv.value
        else:
            view.pop(e.kv.key, None)
        changed.set()

    async def wait_for(pred) -> None:
        while not pred():
            changed.clear()
            await asyncio.wait_for(changed.wait(), 10)

    await store.put(keys.node("a"), b"1")
    cuttable = CuttableStore(store)
    task = asyncio.create_task(follow_prefix(cuttable, keys.nodes_prefix, on_snapshot, on_event,
                                             retry_delay=0.01))
    try:
        await wait_for(lambda: view == {keys.node("a"): b"1"})
        await store.put(keys.node("b"), b"2")
        await wait_for(lambda: keys.node("b") in view)
        resume_from = (await store.get(keys.node("b"))).mod_revision + 1

        # 1. A plain disconnect resumes from the last revision seen: nothing is missed.
        cuttable.cut_next_event = True
        await store.put(keys.node("x"), b"9")  # the cut swallows this delivery ...
        await asyncio.wait_for(cuttable.cut_done.wait(), 10)
        cuttable.reconnect.set()
        await wait_for(lambda: keys.node("x") in view)  # ... and the resumed watch replays it
        assert cuttable.watch_starts[-1] == resume_from
        assert len(snapshots) == 1

        # 2. Disconnected while history is compacted: the follower must re-list.
        cuttable.cut_done.clear()
        cuttable.cut_next_event = True
        await store.put(keys.node("y"), b"8")
        await asyncio.wait_for(cuttable.cut_done.wait(), 10)
        await store.put(keys.node("c"), b"3")
        await store.txn([], [Delete(keys.node("a"))])
        await store.compact((await store.list(keys.nodes_prefix)).revision)
        cuttable.reconnect.set()
        await wait_for(lambda: len(snapshots) == 2)
        assert view == {keys.node(n): v for n, v in (("b", b"2"), ("c", b"3"), ("x", b"9"), ("y", b"8"))}
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_a_closed_store_ends_its_watches(any_store: AnyStore, keys: Keys) -> None:
    """Closing the store ends live watches (aetcd's end quietly; a StoreError would do too:
    follow_prefix resumes either way); they do not hang."""
    r = await any_store.put(keys.node("a"), b"1")
    first = asyncio.Event()

    async def consume() -> None:
        async for _ in any_store.watch(keys.nodes_prefix, r):
            first.set()

    consumer = asyncio.create_task(consume())
    async with asyncio.timeout(10):
        await first.wait()
    await any_store.close()
    done, _ = await asyncio.wait({consumer}, timeout=10)
    assert done == {consumer}
    assert consumer.exception() is None or isinstance(consumer.exception(), StoreError)


# -- MemoryStore only: how tests drive lease time ---------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_memory_store_expires_leases_on_an_injected_clock(keys: Keys) -> None:
    clock = FakeClock()
    async with MemoryStore(clock=clock, auto_expire=False) as store:
        short, long = await store.grant_lease(5), await store.grant_lease(60)
        await store.put(keys.node("short"), b"1", lease=short)
        await store.put(keys.node("long"), b"1", lease=long)
        clock.now += 4
        assert store.expire_due() == [] and await store.keepalive(short) == 5  # refreshed
        clock.now += 4.5
        assert store.expire_due() == []  # 4.5 s since the keep-alive
        assert await store.time_to_live(short) == 0
        clock.now += 0.5
        assert store.expire_due() == [short]
        assert [kv.key for kv in (await store.list(keys.nodes_prefix)).items] == [keys.node("long")]
        assert await store.keepalive(short) == 0


async def test_memory_store_expires_leases_in_real_time(memory_store: MemoryStore,
                                                        keys: Keys) -> None:
    """The default: the TTL passes, the keys go, as with etcd (TTL 2 s, etcd's minimum)."""
    lease = await memory_store.grant_lease(1)
    assert await memory_store.keepalive(lease) == 2  # raised to the minimum
    r = await memory_store.put(keys.node("a"), b"1", lease=lease)
    events = await collect(memory_store, keys.nodes_prefix, r + 1, 1)
    assert summary(events) == [("DELETE", keys.node("a"), b"")]


async def test_memory_store_break_watches_ends_them_with_store_error(memory_store: MemoryStore,
                                                                     keys: Keys) -> None:
    r = await memory_store.put(keys.node("a"), b"1")
    seen: list[str] = []

    async def consume() -> None:
        async for ev in memory_store.watch(keys.nodes_prefix, r):
            seen.append(ev.kv.key)
            memory_store.break_watches()

    with pytest.raises(StoreError, match="connection cut"):
        async with asyncio.timeout(10):
            await consume()
    assert seen == [keys.node("a")]
