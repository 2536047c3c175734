"""The node agent's registration: lease, keep-alive, recovery, revoke — on the in-memory store,
whose leases expire in real time as etcd's do (tests/test_store_contract.py pins that they
behave alike; the real agent process against etcd is in test_integration_agent.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest

from mlx_fleet.contract import (LATENCY_BOUNDS_SECONDS, TOKENS_PER_SECOND_BOUNDS, AssignmentReport,
                                AssignmentState, Histogram, Keys, NodeCapacity, NodeHealth,
                                NodeRecord, RevisionStats, StatsReport)
from mlx_fleet.memstore import MemoryStore
from mlx_fleet.store import Store, WatchEvent
from mlx_fleet.supervise import Supervised
from node_agent.registration import Registration, next_deadline

GiB = 2**30


class Capacity:
    """A controllable capacity source (the real probe's values drift with the host)."""

    def __init__(self) -> None:
        self.value = NodeCapacity(memory_total_bytes=64 * GiB, memory_available_bytes=48 * GiB,
                                  chip="Apple M3 Max", chip_generation=3, simulated=True)

    async def __call__(self) -> NodeCapacity:
        return self.value


@pytest.fixture
def store(memory_store: MemoryStore) -> MemoryStore:
    """The store of every test here: the in-memory one."""
    return memory_store


@pytest.fixture
async def reg(store: MemoryStore, keys: Keys) -> AsyncIterator[Registration]:
    r = Registration(store, keys, node_name="mac-1", address="http://127.0.0.1:8000",
                     capacity=Capacity(), labels={"rack": "a"}, ttl=2, agent_version="test",
                     serving_options={"prompt_cache": "off", "admission_policy": "count"},
                     tasks=["TextGeneration", "TextEmbedding"])
    yield r
    await r.stop()


async def events(store: MemoryStore, prefix: str, start: int, n: int,
                 timeout: float) -> list[WatchEvent]:
    """The next ``n`` watch events under ``prefix`` from revision ``start``."""
    out: list[WatchEvent] = []

    async def collect() -> None:
        async for ev in store.watch(prefix, start):
            out.append(ev)
            if len(out) == n:
                return

    await asyncio.wait_for(collect(), timeout)
    return out


async def test_registers_record_under_lease_and_stop_removes_it(
        store: MemoryStore, keys: Keys, reg: Registration) -> None:
    await reg.start()
    kv = await store.get(keys.node("mac-1"))
    assert kv is not None and reg.lease_id and kv.lease == reg.lease_id
    rec = NodeRecord.from_json(kv.value)
    assert rec.name == "mac-1" and rec.address == "http://127.0.0.1:8000"
    assert rec.labels == {"rack": "a"} and rec.capacity.simulated and rec.agent_version == "test"
    assert rec.serving_options == {"prompt_cache": "off", "admission_policy": "count"}
    assert rec.tasks == ["TextGeneration", "TextEmbedding"]  # what placement filters on
    assert reg.healthy

    await reg.stop()
    assert await store.get(keys.node("mac-1")) is None
    assert not reg.healthy


class CountingKeepalive:
    """The real store, counting answered keep-alives; ``reached(n)`` waits for the n-th."""

    def __init__(self, inner: Store) -> None:
        self._inner = inner
        self.answered = 0
        self.remaining: list[int] = []
        self._changed = asyncio.Condition()

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    async def keepalive(self, lease_id: int) -> int:
        ttl = await self._inner.keepalive(lease_id)
        async with self._changed:
            self.answered += 1
            self.remaining.append(ttl)
            self._changed.notify_all()
        return ttl

    async def reached(self, n: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.answered >= n)


async def test_keepalive_holds_record_past_ttl_without_rewrites(store: MemoryStore,
                                                                keys: Keys) -> None:
    counting = CountingKeepalive(store)
    reg = Registration(counting, keys, node_name="mac-1", address="http://h:1",  # type: ignore[arg-type]
                       capacity=Capacity(), ttl=3)
    try:
        await reg.start()
        kv = await store.get(keys.node("mac-1"))
        assert kv is not None
        # Four keep-alives, each at least TTL/3 after the previous one: more than a TTL has
        # passed since the lease was granted (asserted by counting, not by waiting a fixed time).
        await asyncio.wait_for(counting.reached(4), 60)
        assert all(ttl > 0 for ttl in counting.remaining)  # never found the lease expired
        assert await store.time_to_live(reg.lease_id) > 0  # the store still holds the lease
        after = await store.get(keys.node("mac-1"))
        # the very same write: never expired and re-put, never rewritten per heartbeat
        assert after is not None and after.mod_revision == kv.mod_revision
        assert after.lease == reg.lease_id and reg.registrations == 1 and reg.healthy
    finally:
        await reg.stop()


async def test_record_rewritten_on_material_change(store: MemoryStore, keys: Keys) -> None:
    cap = Capacity()
    health = [NodeHealth.HEALTHY]
    reg = Registration(store, keys, node_name="mac-2", address="http://h:1", capacity=cap,
                       health=lambda: health[0], ttl=3)
    try:
        await reg.start()
        kv = await store.get(keys.node("mac-2"))
        assert kv is not None
        health[0] = NodeHealth.DEGRADED  # read on the next beat
        (ev,) = await events(store, keys.node("mac-2"), kv.mod_revision + 1, 1, timeout=5)
        assert ev.type == "PUT" and NodeRecord.from_json(ev.kv.value).health == NodeHealth.DEGRADED

        cap.value = cap.value.model_copy(update={"memory_available_bytes": 20 * GiB})
        (ev,) = await events(store, keys.node("mac-2"), ev.kv.mod_revision + 1, 1, timeout=5)
        rec = NodeRecord.from_json(ev.kv.value)
        assert rec.capacity.memory_available_bytes == 20 * GiB
    finally:
        await reg.stop()


def stats_report(node: str, requests: int) -> StatsReport:
    def hist(bounds: tuple[float, ...]) -> Histogram:
        return Histogram(bounds=bounds, counts=[0] * (len(bounds) + 1))

    rs = RevisionStats(revision="r2", started_unix=1.0, requests=requests,
                       latency_seconds=hist(LATENCY_BOUNDS_SECONDS),
                       ttft_seconds=hist(LATENCY_BOUNDS_SECONDS),
                       tokens_per_second=hist(TOKENS_PER_SECOND_BOUNDS))
    return StatsReport(node=node, namespace="default", name="llama", canary_uid="u1",
                       revisions={"r2": rs})


async def test_lost_lease_reregisters_with_reports(store: MemoryStore, keys: Keys,
                                                   reg: Registration) -> None:
    await reg.start()
    rkey = keys.report("mac-1", "default", "llama", "r1")
    report = AssignmentReport(node="mac-1", namespace="default", name="llama", revision="r1",
                              state=AssignmentState.READY, reason="ModelLoaded")
    await reg.put_report(rkey, report)
    # a canary's per-deployment statistics are lease-bound too (contract v2)
    skey = keys.stats("mac-1", "default", "llama")
    await reg.put_report(skey, stats_report("mac-1", 7))
    kv = await store.get(rkey)
    assert kv is not None and kv.lease == reg.lease_id
    skv = await store.get(skey)
    assert skv is not None and skv.lease == reg.lease_id
    old_lease = reg.lease_id

    # Behind the agent's back: the lease is revoked (as if it had expired in a partition).
    await store.revoke_lease(old_lease)
    # Three DELETEs (revocation) then three PUTs (re-registration) under the test's root.
    evs = await events(store, keys.root + "/", skv.mod_revision + 1, 6, timeout=10)
    assert [e.type for e in evs[:3]] == ["DELETE"] * 3
    puts = {e.kv.key: e.kv for e in evs[3:]}
    assert set(puts) == {keys.node("mac-1"), rkey, skey}
    new_lease = puts[rkey].lease
    assert new_lease != old_lease and puts[keys.node("mac-1")].lease == new_lease
    assert puts[skey].lease == new_lease
    # A report written after recovery goes under the new lease (put_report waits for the
    # re-registration to finish: both take the registration's write lock).
    rkey2 = keys.report("mac-1", "default", "llama", "r2")
    await reg.put_report(rkey2, report.model_copy(update={"revision": "r2"}))
    kv2 = await store.get(rkey2)
    assert kv2 is not None and kv2.lease == new_lease == reg.lease_id
    assert reg.registrations == 2
    assert AssignmentReport.from_json(puts[rkey].value).state == AssignmentState.READY
    assert StatsReport.from_json(puts[skey].value).revisions["r2"].requests == 7
    assert reg.healthy


async def test_delete_report_and_revoke_on_stop(store: MemoryStore, keys: Keys,
                                                reg: Registration) -> None:
    await reg.start()
    # two revisions of one deployment have a report each: deleting one keeps the other
    k1, k2 = keys.report("mac-1", "ns", "a", "r1"), keys.report("mac-1", "ns", "a", "r2")
    for k, rev in ((k1, "r1"), (k2, "r2")):
        await reg.put_report(k, AssignmentReport(node="mac-1", namespace="ns", name="a",
                                                 revision=rev, state=AssignmentState.LOADING))
    skey = keys.stats("mac-1", "ns", "a")
    await reg.put_report(skey, stats_report("mac-1", 1))
    await reg.delete_report(k1)
    assert await store.get(k1) is None and await store.get(k2) is not None
    assert reg.report(k1) is None and reg.report(k2) is not None
    await reg.delete_report(skey)
    assert await store.get(skey) is None
    await reg.stop()
    listing = await store.list(keys.root + "/")
    assert listing.items == []


def test_ttl_must_be_positive(keys: Keys) -> None:
    with pytest.raises(ValueError, match="TTL"):
        Registration(None, keys, node_name="x", address="", capacity=Capacity(), ttl=0)  # type: ignore[arg-type]


async def test_supervised_task_logs_a_bug_and_restarts(caplog: pytest.LogCaptureFixture) -> None:
    runs = 0
    failed, rerun = asyncio.Event(), asyncio.Event()

    async def work() -> None:
        nonlocal runs
        runs += 1
        if runs == 1:
            failed.set()
            raise RuntimeError("injected bug")
        rerun.set()
        await asyncio.Event().wait()  # runs until stopped

    task = Supervised("test:work", work, initial_backoff=0.05, max_backoff=0.1)
    with caplog.at_level(logging.ERROR, logger="mlx_fleet.supervise"):
        task.start()
        try:
            await asyncio.wait_for(failed.wait(), 30)
            # the failure is visible (for /health) while the restart waits
            assert task.backing_off and task.last_error == "RuntimeError: injected bug"
            await asyncio.wait_for(rerun.wait(), 30)
            assert not task.backing_off and task.restarts == 1 and runs == 2
        finally:
            await task.stop()
    logged = [r for r in caplog.records if "test:work" in r.getMessage()]
    assert logged and logged[0].exc_info is not None  # with its traceback


@pytest.mark.parametrize("previous, now, due", [
    (10.0, 10.5, 15.0),   # a quick beat: the next one a period after the previous deadline
    (10.0, 13.0, 15.0),   # a slow beat doesn't shift the cadence
    (10.0, 15.0, 15.0),   # due right now
    (10.0, 17.0, 17.0),   # overran a period: due at once, no burst of catch-up beats
])
def test_next_deadline_keeps_a_fixed_cadence(previous: float, now: float, due: float) -> None:
    assert next_deadline(previous, 5.0, now) == due


class UnansweredKeepalive:
    """The real store, except that the first keep-alive never gets an answer."""

    def __init__(self, inner: Store) -> None:
        self._inner = inner
        self.calls = 0
        self.second_call = asyncio.Event()
        self.second_answered = asyncio.Event()
        self.reachable_at_second_call: bool | None = None
        self.reg: Registration | None = None

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    async def keepalive(self, lease_id: int) -> int:
        self.calls += 1
        if self.calls == 1:
            await asyncio.Event().wait()  # hangs (until cancelled)
        if self.calls == 2:
            assert self.reg is not None
            self.reachable_at_second_call = self.reg.status()["etcd_reachable"]
            self.second_call.set()
        ttl = await self._inner.keepalive(lease_id)
        if self.calls == 2:
            self.second_answered.set()
        return ttl


async def test_unanswered_keepalive_times_out_within_the_period(store: MemoryStore,
                                                                keys: Keys) -> None:
    flaky = UnansweredKeepalive(store)
    reg = Registration(flaky, keys, node_name="mac-3", address="http://h:1",  # type: ignore[arg-type]
                       capacity=Capacity(), ttl=4)
    flaky.reg = reg
    try:
        await reg.start()
        # The hung keep-alive is abandoned after ttl/3 and counted as a failure; the next one
        # still goes out, so the lease (three periods long) survives.
        await asyncio.wait_for(flaky.second_answered.wait(), 30)
        assert flaky.reachable_at_second_call is False
        assert reg.healthy and reg.registrations == 1
        kv = await store.get(keys.node("mac-3"))
        assert kv is not None and kv.lease == reg.lease_id
    finally:
        await reg.stop()


class HangingPuts:
    """The real store, counting answered keep-alives; once ``hang`` is set, puts and
    transactions never answer (until ``release`` is set, when they go through)."""

    def __init__(self, inner: Store) -> None:
        self._inner = inner
        self.hang = False
        self.release = asyncio.Event()
        self.hung_writes = 0
        self.keepalives = 0
        self.remaining: list[int] = []
        self._changed = asyncio.Condition()

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    async def _maybe_hang(self) -> None:
        if self.hang:
            async with self._changed:
                self.hung_writes += 1
                self._changed.notify_all()
            await self.release.wait()

    async def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        await self._maybe_hang()
        return await self._inner.put(key, value, lease=lease)

    async def txn(self, *args, **kwargs) -> bool:
        await self._maybe_hang()
        return await self._inner.txn(*args, **kwargs)

    async def keepalive(self, lease_id: int) -> int:
        ttl = await self._inner.keepalive(lease_id)
        async with self._changed:
            self.keepalives += 1
            self.remaining.append(ttl)
            self._changed.notify_all()
        return ttl

    async def until(self, predicate) -> None:
        async with self._changed:
            await self._changed.wait_for(predicate)


async def test_hung_record_and_report_writes_never_delay_keepalives(store: MemoryStore,
                                                                    keys: Keys) -> None:
    wrapped = HangingPuts(store)
    cap = Capacity()
    health = [NodeHealth.HEALTHY]
    reg = Registration(wrapped, keys, node_name="mac-4", address="http://h:1",  # type: ignore[arg-type]
                       capacity=cap, health=lambda: health[0], ttl=3)
    rkey = keys.report("mac-4", "default", "llama", "r1")
    report = AssignmentReport(node="mac-4", namespace="default", name="llama", revision="r1",
                              state=AssignmentState.LOADING)
    try:
        await reg.start()
        lease = reg.lease_id
        # A model load: the record (health, available memory) and a report change at once,
        # and etcd stops answering writes (but not keep-alives).
        wrapped.hang = True
        cap.value = cap.value.model_copy(update={"memory_available_bytes": 8 * GiB})
        health[0] = NodeHealth.DEGRADED
        # put_report is bounded too: it returns (the write is retried later) instead of hanging.
        await asyncio.wait_for(reg.put_report(rkey, report), 30)
        await asyncio.wait_for(wrapped.until(lambda: wrapped.hung_writes >= 2), 30)
        start = wrapped.keepalives
        # Four more keep-alives while writes hang: more than a TTL's worth of them (each at
        # least TTL/3 after the previous one), so the lease survived only because they went out.
        await asyncio.wait_for(wrapped.until(lambda: wrapped.keepalives >= start + 4), 60)
        assert all(ttl > 0 for ttl in wrapped.remaining)
        assert await store.time_to_live(lease) > 0
        assert reg.lease_id == lease and reg.registrations == 1
        kv = await store.get(keys.node("mac-4"))
        assert kv is not None and kv.lease == lease
        assert NodeRecord.from_json(kv.value).health == NodeHealth.HEALTHY  # not written yet
        assert await store.get(rkey) is None

        # etcd answers writes again: the pending record and report are written, same lease.
        wrapped.hang = False
        wrapped.release.set()
        (ev,) = await events(store, rkey, kv.mod_revision + 1, 1, timeout=30)
        assert ev.kv.lease == lease
        rec_kv = await store.get(keys.node("mac-4"))
        while rec_kv is not None and NodeRecord.from_json(rec_kv.value).health != NodeHealth.DEGRADED:
            (ev,) = await events(store, keys.node("mac-4"), rec_kv.mod_revision + 1, 1, timeout=30)
            rec_kv = ev.kv
        assert rec_kv is not None and rec_kv.lease == lease
        assert NodeRecord.from_json(rec_kv.value).capacity.memory_available_bytes == 8 * GiB
    finally:
        wrapped.release.set()
        await reg.stop()


class AnsweredOnCue:
    """The real store, except that a put's answer is held back until the test releases it
    (``answer``)."""

    def __init__(self, inner: Store) -> None:
        self._inner = inner
        self.waiting = asyncio.Event()
        self._answer: asyncio.Future | None = None

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    async def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        revision = await self._inner.put(key, value, lease=lease)
        self._answer = asyncio.get_running_loop().create_future()
        self.waiting.set()
        await self._answer  # the answer arrives when the test says so
        return revision

    def answer(self) -> None:
        assert self._answer is not None
        self._answer.set_result(None)


async def test_a_write_cancelled_as_etcd_answers_is_still_cancelled(store: MemoryStore,
                                                                    keys: Keys) -> None:
    # Supervised.stop() cancels a task and waits for it: a cancellation lost inside a bounded
    # write (asyncio.wait_for on Python 3.11 returns the result when the call completes in the
    # same loop iteration) would leave e.g. the converge worker running and stop() hanging.
    cued = AnsweredOnCue(store)
    reg = Registration(cued, keys, node_name="mac-5", address="http://h:1",  # type: ignore[arg-type]
                       capacity=Capacity(), ttl=3)
    try:
        await reg.start()  # the record goes in by a transaction, not a put
        rkey = keys.report("mac-5", "default", "llama", "r1")
        writing = asyncio.create_task(reg.put_report(rkey, AssignmentReport(
            node="mac-5", namespace="default", name="llama", revision="r1",
            state=AssignmentState.LOADING)))
        await asyncio.wait_for(cued.waiting.wait(), 10)
        cued.answer()      # etcd answers ...
        writing.cancel()   # ... in the very loop iteration the writer is cancelled
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(writing, 10)
    finally:
        await reg.stop()
