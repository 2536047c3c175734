"""The project's etcd interface against a real etcd: fencing, leases, watches, compaction."""

from __future__ import annotations

import asyncio

import pytest

from mlx_fleet.contract import Keys
from mlx_fleet.store import (
    Compacted,
    Compare,
    Delete,
    EtcdStore,
    Put,
    Snapshot,
    StoreError,
    WatchEvent,
    follow_prefix,
)


async def test_txn_is_fenced_on_mod_revision(store: EtcdStore, keys: Keys) -> None:
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


async def test_list_reports_revision_and_sorted_items(store: EtcdStore, keys: Keys) -> None:
    for name in ("b", "a", "c"):
        await store.put(keys.node(name), name.encode())
    listing = await store.list(keys.nodes_prefix)
    assert [kv.key for kv in listing.items] == [keys.node(n) for n in "abc"]
    assert listing.revision >= max(kv.mod_revision for kv in listing.items)


async def test_lease_revocation_deletes_attached_keys(store: EtcdStore, keys: Keys) -> None:
    lease = await store.grant_lease(30)
    assert await store.keepalive(lease) > 0
    await store.put(keys.node("leased"), b"x", lease=lease)
    assert (await store.get(keys.node("leased"))).lease == lease
    await store.revoke_lease(lease)
    assert await store.get(keys.node("leased")) is None


async def test_watch_from_revision_then_compacted(store: EtcdStore, keys: Keys) -> None:
    start = (await store.list(keys.nodes_prefix)).revision + 1
    await store.put(keys.node("w1"), b"1")
    await store.txn([], [Delete(keys.node("w1"))])
    seen: list[WatchEvent] = []
    async for ev in store.watch(keys.nodes_prefix, start):
        seen.append(ev)
        if len(seen) == 2:
            break
    assert [(e.type, e.kv.key) for e in seen] == [("PUT", keys.node("w1")), ("DELETE", keys.node("w1"))]

    now = (await store.list(keys.nodes_prefix)).revision
    await store._client.compact(now)  # test-only: compaction is an etcd admin operation
    with pytest.raises(Compacted):
        async for _ in store.watch(keys.nodes_prefix, start):
            pass


class CuttableStore:
    """Delegates to a real store; the test can break the follower's watch stream (as a network
    cut would) and hold the reconnect until it has compacted etcd behind the follower's back."""

    def __init__(self, inner: EtcdStore) -> None:
        self.inner = inner
        self.cut_next_event = False
        self.cut_done = asyncio.Event()
        self.reconnect = asyncio.Event()
        self.reconnect.set()
        self.watch_starts: list[int] = []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    async def watch(self, prefix: str, start_revision: int):
        await self.reconnect.wait()
        self.watch_starts.append(start_revision)
        async for ev in self.inner.watch(prefix, start_revision):
            if self.cut_next_event:
                self.cut_next_event = False
                self.reconnect.clear()
                self.cut_done.set()
                raise StoreError("connection cut by the test")
            yield ev


async def test_follow_prefix_resumes_then_relists_after_compaction(store: EtcdStore, keys: Keys) -> None:
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
        await store._client.compact((await store.list(keys.nodes_prefix)).revision)
        cuttable.reconnect.set()
        await wait_for(lambda: len(snapshots) == 2)
        assert view == {keys.node(n): v for n, v in (("b", b"2"), ("c", b"3"), ("x", b"9"), ("y", b"8"))}
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


@pytest.mark.parametrize(("endpoint", "target"), [
    ("http://127.0.0.1:2379", ("127.0.0.1", 2379, False)),
    ("127.0.0.1:4001", ("127.0.0.1", 4001, False)),
    ("http://etcd.example", ("etcd.example", 2379, False)),
    ("http://[::1]:2379", ("[::1]", 2379, False)),
    ("https://etcd:2379", ("etcd", 2379, True)),
])
def test_parse_endpoint(endpoint: str, target: tuple[str, int, bool]) -> None:
    from mlx_fleet.store import parse_endpoint

    assert parse_endpoint(endpoint) == target


@pytest.mark.parametrize("endpoint", ["unix:///run/etcd.sock", "http://", "http://h:notaport"])
def test_parse_endpoint_refuses(endpoint: str) -> None:
    from mlx_fleet.store import parse_endpoint

    with pytest.raises(ValueError, match="etcd endpoint"):
        parse_endpoint(endpoint)


async def test_parsed_endpoint_connects(etcd_server) -> None:
    """What parse_endpoint makes of the real etcd's URL is a target the client can use."""
    from mlx_fleet.store import parse_endpoint

    host, port, _ = parse_endpoint(etcd_server.client_url)
    async with EtcdStore(f"http://{host}:{port}") as s:
        assert (await s.list("/nothing-here/")).items == []


async def test_a_watch_never_yields_a_key_outside_its_prefix(store, keys) -> None:
    """A misrouted watch (aetcd bound it to another watch's stream) ends with StoreError, so
    follow_prefix resumes on a fresh one instead of yielding foreign keys or going silent."""
    from mlx_fleet.store import StoreError

    class Misrouted:
        def __init__(self, events):
            self._events = events

        def __aiter__(self):
            return self._aiter()

        async def _aiter(self):
            for e in self._events:
                yield e

        async def cancel(self):
            return None

    class Kv:
        def __init__(self, key: bytes):
            self.key, self.value = key, b"{}"
            self.mod_revision = self.create_revision = self.version = 1
            self.lease = 0

    class Ev:
        kind = "PUT"

        def __init__(self, key: bytes):
            self.kv = Kv(key)

    prefix = keys.reports_prefix
    inside = (prefix + "n/ns/d/v1").encode()
    outside = (keys.assignments_prefix + "n/ns/d/v1").encode()

    async def fake_watch(key, range_end, start_revision):
        return Misrouted([Ev(inside), Ev(outside)])

    store._client.watch = fake_watch  # type: ignore[attr-defined]
    seen = []
    with pytest.raises(StoreError, match="outside the prefix"):
        async for ev in store.watch(prefix, 1):
            seen.append(ev.kv.key)
    assert seen == [inside.decode()]


async def test_cancelling_a_watch_is_bounded_when_the_client_is_stuck(store, keys, monkeypatch) -> None:
    """aetcd's watch cancel takes its watcher's lock (and a slot in a bounded request queue);
    on a broken stream that never comes. Cancelling the consumer must still finish, and close
    must still close: seen in CI as a follower cancel that hung a test for 10 minutes."""
    import mlx_fleet.store as store_module

    monkeypatch.setattr(store_module, "CLOSE_TIMEOUT_SECONDS", 0.2)
    prefix = keys.nodes_prefix
    first = asyncio.Event()

    revision = await store.put(prefix + "x", b"1")

    async def consume() -> None:
        async for _ in store.watch(prefix, revision):
            first.set()

    consumer = asyncio.create_task(consume())
    async with asyncio.timeout(10):
        await first.wait()  # the watch exists and delivers
    watcher = store._client._watcher  # type: ignore[attr-defined]
    await watcher._lock.acquire()  # what a stuck response handler holds
    consumer.cancel()
    # (not pytest.raises inside asyncio.timeout: the timeout's own CancelledError would pass)
    done, _ = await asyncio.wait({consumer}, timeout=5)
    assert done == {consumer} and consumer.cancelled()
    closing = asyncio.ensure_future(store.close())  # its watcher shutdown waits on the same
    done, _ = await asyncio.wait({closing}, timeout=5)  # lock: bounded too
    watcher._lock.release()
    assert done == {closing}


async def test_cancelling_a_watch_being_created_is_bounded_when_the_client_is_stuck(
        store, keys, monkeypatch) -> None:
    """A watch cancelled while aetcd is still creating it — waiting for etcd's "created" answer
    on a condition of its watcher's lock — while a stuck response handler holds that lock: the
    cancelled wait would have to take the lock again, forever. The cancel returns at once (seen
    in CI: a test's follower cancel that never returned, 600 s)."""
    await store.list(keys.nodes_prefix)  # connected: the watcher exists
    watcher = store._client._watcher  # type: ignore[attr-defined]
    stuck, release = asyncio.Event(), asyncio.Event()

    async def stuck_handler(response) -> None:  # holds the lock like a handler whose
        async with watcher._lock:               # request-queue put never completes
            stuck.set()
            await release.wait()

    monkeypatch.setattr(watcher, "_handle_response", stuck_handler)

    async def consume() -> None:
        async for _ in store.watch(keys.nodes_prefix, 1):
            pass

    consumer = asyncio.create_task(consume())
    async with asyncio.timeout(10):
        await stuck.wait()  # the create was sent; its answer holds the lock
    consumer.cancel()
    done, _ = await asyncio.wait({consumer}, timeout=5)
    release.set()
    assert done == {consumer} and consumer.cancelled()
