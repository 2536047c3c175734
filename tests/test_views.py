"""mlx_fleet.views.PrefixView on the in-memory store: typed records by key, changes reported
once, malformed values logged and left out, re-listing after compaction, waiting on a
revision instead of sleeping."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest

from mlx_fleet.contract import Keys, TrafficSplit
from mlx_fleet.memstore import MemoryStore
from mlx_fleet.store_api import Delete, Put
from mlx_fleet.views import PrefixView, ViewUpdate

NS = "default"


def split(weight: int, candidate: str = "r2") -> TrafficSplit:
    return TrafficSplit(namespace=NS, name="d", canary_uid="u1", stable_revision="r1",
                        candidate_revision=candidate, weight=weight, served_model_name="m")


class Recorder:
    """The view's updates as plain tuples: (listing, [(key, old weight, new weight)])."""

    def __init__(self) -> None:
        self.updates: list[tuple[bool, list[tuple[tuple[str, str], int | None, int | None]]]] = []

    def __call__(self, u: ViewUpdate[tuple[str, str], TrafficSplit]) -> None:
        self.updates.append((u.listing, [(c.key, c.old and c.old.weight, c.new and c.new.weight)
                                         for c in u.changes]))


def make_view(store: MemoryStore, keys: Keys, rec: Recorder):
    return PrefixView(store, keys.traffic_prefix, parse_key=keys.parse_traffic,
                      parse_value=lambda _k, raw: TrafficSplit.from_json(raw), on_change=rec,
                      name="splits")


@pytest.fixture
async def view(memory_store: MemoryStore, keys: Keys) -> AsyncIterator[
        tuple[PrefixView[tuple[str, str], TrafficSplit], Recorder]]:
    rec = Recorder()
    v = make_view(memory_store, keys, rec)
    task = asyncio.create_task(v.run(retry_delay=0.01))
    yield v, rec
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_first_listing_then_events_keep_typed_records(memory_store: MemoryStore,
                                                            keys: Keys) -> None:
    await memory_store.put(keys.traffic(NS, "a"), split(10).to_json())
    rec = Recorder()
    v = make_view(memory_store, keys, rec)
    task = asyncio.create_task(v.run())
    try:
        async with asyncio.timeout(10):
            await v.synced.wait()
            assert rec.updates == [(True, [((NS, "a"), None, 10)])]
            r = await memory_store.put(keys.traffic(NS, "b"), split(20).to_json())
            await v.wait_for(r)
            assert {k: s.weight for k, s in v.items.items()} == {(NS, "a"): 10, (NS, "b"): 20}
            assert v.kvs[(NS, "b")].mod_revision == r
            r = await memory_store.put(keys.traffic(NS, "a"), split(30).to_json())
            await v.wait_for(r)
            r = await memory_store.txn([], [Delete(keys.traffic(NS, "b"))])
            await v.wait_for(r)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert {k: s.weight for k, s in v.items.items()} == {(NS, "a"): 30}
    assert v.revision == r == memory_store.revision
    assert rec.updates[1:] == [(False, [((NS, "b"), None, 20)]),
                               (False, [((NS, "a"), 10, 30)]),
                               (False, [((NS, "b"), 20, None)])]


async def test_the_first_listing_is_reported_even_when_empty(memory_store: MemoryStore,
                                                             keys: Keys, view) -> None:
    v, rec = view
    async with asyncio.timeout(10):
        await v.synced.wait()
    assert rec.updates == [(True, [])] and v.items == {} and v.listings == 1


async def test_a_malformed_record_is_logged_and_left_out(memory_store: MemoryStore, keys: Keys,
                                                         view, caplog) -> None:
    v, rec = view
    caplog.set_level(logging.ERROR, logger="mlx_fleet.views")
    async with asyncio.timeout(10):
        await v.synced.wait()
        r = await memory_store.put(keys.traffic(NS, "a"), split(10).to_json())
        await v.wait_for(r)
        r = await memory_store.put(keys.traffic(NS, "a"), b"{not json")  # corrupted: gone
        await v.wait_for(r)
        assert v.items == {}
        r = await memory_store.put(keys.traffic(NS, "x"), b'{"weight": 500}')  # never valid
        await v.wait_for(r)
        r = await memory_store.put(keys.traffic(NS, "a"), split(40).to_json())  # mended
        await v.wait_for(r)
    assert {k: s.weight for k, s in v.items.items()} == {(NS, "a"): 40}
    assert rec.updates[1:] == [(False, [((NS, "a"), None, 10)]),
                               (False, [((NS, "a"), 10, None)]),
                               (False, [((NS, "a"), None, 40)])]  # the never-valid x: nothing
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2 and all("malformed record" in m for m in logged)
    assert keys.traffic(NS, "a") in logged[0] and keys.traffic(NS, "x") in logged[1]


async def test_keys_outside_the_layout_are_ignored(memory_store: MemoryStore, keys: Keys,
                                                   view) -> None:
    v, rec = view
    async with asyncio.timeout(10):
        await v.synced.wait()
        await memory_store.put(keys.traffic_prefix + "too/many/segments", split(1).to_json())
        r = await memory_store.put(keys.traffic(NS, "a"), split(5).to_json())
        await v.wait_for(r)
    assert list(v.items) == [(NS, "a")] and rec.updates[1:] == [(False, [((NS, "a"), None, 5)])]


async def test_relisting_after_compaction_reports_only_what_changed(memory_store: MemoryStore,
                                                                    keys: Keys, view) -> None:
    """Cut off while keys change and history is compacted: the view re-lists and reports
    exactly the keys written or deleted meanwhile, by their mod_revision."""
    v, rec = view
    for name, weight in (("same", 1), ("changed", 2), ("deleted", 3)):
        await memory_store.put(keys.traffic(NS, name), split(weight).to_json())
    async with asyncio.timeout(10):
        await v.wait_until(lambda items: len(items) == 3)
    before = len(rec.updates)
    # the store cuts the watch and compacts before the view can resume from where it was
    memory_store.break_watches()
    await memory_store.txn([], [Put(keys.traffic(NS, "changed"), split(22).to_json()),
                                Delete(keys.traffic(NS, "deleted")),
                                Put(keys.traffic(NS, "new"), split(4).to_json())])
    await memory_store.put(keys.nodes_prefix + "elsewhere", b"x")
    await memory_store.compact(memory_store.revision)  # above where the view would resume
    async with asyncio.timeout(10):
        await v.wait_until(lambda items: v.listings == 2)
    assert {k[1]: s.weight for k, s in v.items.items()} == {"same": 1, "changed": 22, "new": 4}
    assert [(listing, sorted(changes)) for listing, changes in rec.updates[before:]] == [
        (True, [((NS, "changed"), 2, 22), ((NS, "deleted"), 3, None), ((NS, "new"), None, 4)])]


async def test_relisting_with_nothing_changed_reports_nothing(memory_store: MemoryStore,
                                                              keys: Keys, view) -> None:
    v, rec = view
    r = await memory_store.put(keys.traffic(NS, "a"), split(1).to_json())
    async with asyncio.timeout(10):
        await v.wait_for(r)
        before = len(rec.updates)
        memory_store.break_watches()
        await memory_store.put(keys.nodes_prefix + "elsewhere", b"x")  # moves the revision
        await memory_store.put(keys.nodes_prefix + "elsewhere", b"y")
        await memory_store.compact(memory_store.revision)  # above where the view would resume
        await v.wait_until(lambda items: v.listings == 2)
    assert rec.updates[before:] == [] and v.revision == memory_store.revision


async def test_an_async_callback_is_awaited_and_its_error_ends_the_view(
        memory_store: MemoryStore, keys: Keys) -> None:
    seen: list[int] = []

    async def on_change(u: ViewUpdate) -> None:
        await asyncio.sleep(0)
        seen.extend(c.new.weight for c in u.changes if c.new)
        if any(c.new and c.new.weight == 99 for c in u.changes):
            raise RuntimeError("a bug in the caller")

    v = PrefixView(memory_store, keys.traffic_prefix, parse_key=keys.parse_traffic,
                   parse_value=lambda _k, raw: TrafficSplit.from_json(raw), on_change=on_change)
    task = asyncio.create_task(v.run())
    await memory_store.put(keys.traffic(NS, "a"), split(1).to_json())
    await memory_store.put(keys.traffic(NS, "a"), split(99).to_json())
    with pytest.raises(RuntimeError, match="a bug in the caller"):
        async with asyncio.timeout(10):
            await task
    assert seen[-1] == 99 and 1 in seen


async def test_wait_for_returns_at_once_for_a_revision_already_applied(
        memory_store: MemoryStore, keys: Keys, view) -> None:
    v, _ = view
    r = await memory_store.put(keys.traffic(NS, "a"), split(1).to_json())
    async with asyncio.timeout(10):
        await v.wait_for(r)
    waiter = asyncio.ensure_future(v.wait_for(r))
    await asyncio.sleep(0)
    assert waiter.done()


async def test_a_malformed_record_in_a_listing_is_left_out(memory_store: MemoryStore,
                                                           keys: Keys, caplog) -> None:
    caplog.set_level(logging.ERROR, logger="mlx_fleet.views")
    await memory_store.put(keys.traffic(NS, "bad"), b"[]")
    await memory_store.put(keys.traffic(NS, "good"), split(7).to_json())
    rec = Recorder()
    v = make_view(memory_store, keys, rec)
    task = asyncio.create_task(v.run())
    try:
        async with asyncio.timeout(10):
            await v.synced.wait()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert rec.updates == [(True, [((NS, "good"), None, 7)])]
    assert [r.getMessage().split("):")[0] for r in caplog.records] == [
        f"view splits: ignoring malformed record {keys.traffic(NS, 'bad')} (revision 2"]
