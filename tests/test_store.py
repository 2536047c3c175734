"""What only the etcd-backed store has: endpoint parsing, and aetcd's watch pitfalls.

The behaviour every Store shares (fencing, leases, watches, compaction, follow_prefix) is in
tests/test_store_contract.py, run on the real etcd and on the in-memory store."""

from __future__ import annotations

import asyncio

import pytest

from mlx_fleet.store import EtcdStore


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
