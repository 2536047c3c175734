"""Helpers shared by the integration tests: wait on etcd state through a real watch, and
node records as an agent would write them. Imported as ``from fleet_helpers import ...``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from mlx_fleet.contract import Assignment, Keys, NodeCapacity, NodeRecord
from mlx_fleet.store import Snapshot, Store, WatchEvent, follow_prefix

GiB = 1024**3


async def watch_until(store: Store, prefix: str, predicate: Callable[[dict[str, bytes]], bool],
                      timeout: float = 60.0) -> dict[str, bytes]:
    """Follow ``prefix`` (list, then watch) until ``predicate(key → value)`` holds; return that
    view. Raises ``TimeoutError`` after ``timeout`` seconds."""
    view: dict[str, bytes] = {}
    done = asyncio.Event()

    async def on_snapshot(snap: Snapshot) -> None:
        view.clear()
        view.update({kv.key: kv.value for kv in snap.items})
        if predicate(view):
            done.set()

    async def on_event(ev: WatchEvent) -> None:
        if ev.type == "PUT":
            view[ev.kv.key] = ev.kv.value
        else:
            view.pop(ev.kv.key, None)
        if predicate(view):
            done.set()

    task = asyncio.create_task(follow_prefix(store, prefix, on_snapshot, on_event))
    try:
        await asyncio.wait_for(done.wait(), timeout)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    return dict(view)


async def until_assignments(store: Store, keys: Keys, predicate: Callable[[dict[str, Assignment]], bool],
                            timeout: float = 60.0) -> dict[str, Assignment]:
    """:func:`watch_until` over ``assignments/``, seen as node → assignment (one deployment)."""

    def by_node(raw: dict[str, bytes]) -> dict[str, Assignment]:
        return {keys.parse_assignment(k)[0]: Assignment.from_json(v) for k, v in raw.items()}

    return by_node(await watch_until(store, keys.assignments_prefix,
                                     lambda raw: predicate(by_node(raw)), timeout))


def node_record(name: str, *, chip: str = "Apple M4 Max", generation: int = 4,
                memory_gib: int = 64) -> NodeRecord:
    """A simulated Mac's node record, as its agent would register it."""
    return NodeRecord(name=name, address=f"http://{name}.local:8000",
                      capacity=NodeCapacity(memory_total_bytes=memory_gib * GiB,
                                            memory_available_bytes=(memory_gib - 4) * GiB,
                                            chip=chip, chip_generation=generation, simulated=True))
