"""The agent's canary side (node_agent.traffic.TrafficManager) against the in-memory store, a
real ServingCore and generated MLX models: splits followed from the store, routing,
per-revision statistics written under the lease at a bounded rate, the local guard. (Nothing
here is about etcd itself: the store's behaviour is pinned by tests/test_store_contract.py.)"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from mlx_fleet.source_policy import DEV_POLICY  # models in temporary directories
from mlx_fleet.contract import (Assignment, AssignmentReport, AssignmentState, Keys, LocalGuard,
                                ModelSource, NodeCapacity, Role, StatsReport, TrafficSplit)
from mlx_fleet.memstore import MemoryStore
from mlx_fleet.routing.split import bucket
from mlx_fleet.store import Store, WatchEvent
from mlx_fleet.testmodel import Fault, make_test_model
from node_agent import traffic as traffic_module
from node_agent.controller import Controller
from node_agent.registration import Registration
from node_agent.serving import GenerationAborted, ServingCore
from node_agent.traffic import Routed, TrafficManager
from serving_fixtures import other_model_path, tiny_model_path, wait_for  # noqa: F401

NODE = "mac-1"
NS, DEP, MODEL = "default", "chat", "tiny-chat"
TIMEOUT = 60
FAULT_AFTER = 1
KEYS = [f"session-{i}" for i in range(200)]


def candidate_side(key: str, weight: int) -> bool:
    return bucket(f"{NS}/{DEP}", key) < weight * 100


def split(weight: int, *, candidate: str = "r2", uid: str = "uid-1", interval: float = 10.0,
          guard: LocalGuard | None = None) -> TrafficSplit:
    return TrafficSplit(namespace=NS, name=DEP, served_model_name=MODEL, stable_revision="r1",
                        candidate_revision=candidate, weight=weight, canary="c",
                        canary_uid=uid, stats_interval_seconds=interval,
                        guard=guard or LocalGuard())


class Clock:
    """Unix time as the test says (the statistics' rate limit reads it)."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class Ticks:
    """Counts the statistics writer's passes (TrafficManager.write_due, spied on)."""

    def __init__(self, tm: TrafficManager) -> None:
        self.n = 0
        self._cond = asyncio.Condition()
        real = tm.write_due

        async def counted(**kw) -> int:
            written = await real(**kw)
            async with self._cond:
                self.n += 1
                self._cond.notify_all()
            return written

        tm.write_due = counted  # type: ignore[method-assign]

    async def passes(self, n: int) -> None:
        """Wait until ``n`` more passes have run."""
        async with self._cond:
            target = self.n + n
            await asyncio.wait_for(self._cond.wait_for(lambda: self.n >= target), TIMEOUT)


class StatsWatch:
    """Every store event on one stats key from ``start`` on, collected by a watch."""

    def __init__(self, store: Store, key: str, start: int) -> None:
        self.store, self.key = store, key
        self.events: list[WatchEvent] = []
        self._cond = asyncio.Condition()
        self._task = asyncio.create_task(self._run(start))

    async def _run(self, start: int) -> None:
        async for ev in self.store.watch(self.key, start):  # the key and key/sentinel
            async with self._cond:
                self.events.append(ev)
                self._cond.notify_all()

    def ours(self) -> list[WatchEvent]:
        return [e for e in self.events if e.kv.key == self.key]

    def puts(self) -> list[StatsReport]:
        return [StatsReport.from_json(e.kv.value) for e in self.ours() if e.type == "PUT"]

    async def until(self, cond: Callable[[], bool]) -> None:
        async with self._cond:
            await asyncio.wait_for(self._cond.wait_for(cond), TIMEOUT)

    async def settle(self) -> None:
        """Return once every write made to the store before this call has been seen."""
        rev = await self.store.put(self.key + "/sentinel", b"")
        await self.until(lambda: any(e.kv.mod_revision >= rev for e in self.events))

    async def close(self) -> None:
        self._task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self._task


# ---------------------------------------------------------------------------------------------
# fixtures: a node (registration + controller holding revisions of MODEL) in the store
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def store(memory_store: MemoryStore) -> MemoryStore:
    """The store of every test here: the in-memory one."""
    return memory_store


@pytest.fixture(scope="module")
def faulty_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_test_model(tmp_path_factory.mktemp("models") / "faulty",
                           fault=Fault("raise", after_tokens=FAULT_AFTER))


@pytest.fixture(scope="module")
async def core() -> AsyncIterator[ServingCore]:
    c = ServingCore()
    await c.start()
    yield c
    await c.close()


async def _capacity() -> NodeCapacity:
    return NodeCapacity(memory_total_bytes=64 * 2**30, memory_available_bytes=48 * 2**30,
                        chip="Apple M3 Max", chip_generation=3, simulated=True)


@pytest.fixture
async def registration(store: Store, keys: Keys) -> AsyncIterator[Registration]:
    reg = Registration(store, keys, node_name=NODE, address="http://agent.test:8000",
                       capacity=_capacity, ttl=5)
    await reg.start()
    yield reg
    await reg.stop()


Holder = Callable[[dict[str, tuple[Path, Role]]], Awaitable[Controller]]


@pytest.fixture
async def hold(store: Store, keys: Keys, core: ServingCore,
               registration: Registration) -> AsyncIterator[Holder]:
    """``await hold({revision: (model dir, role)})``: assign those revisions of MODEL to the
    node, run its controller (as the agent does) and return it once all are Ready."""
    ctls: list[Controller] = []

    async def start(revisions: dict[str, tuple[Path, Role]]) -> Controller:
        ctl = Controller(store, keys, node_name=NODE, core=core, registration=registration,
                         advertise_url="http://agent.test:8000", source_policy=DEV_POLICY)
        ctls.append(ctl)
        for rev, (path, role) in revisions.items():
            a = Assignment(namespace=NS, name=DEP, served_model_name=MODEL,
                           source=ModelSource(uri=f"file://{path}", revision=rev),
                           memory_bytes=2**20, role=role)
            await store.put(keys.assignment(NODE, NS, DEP, rev), a.to_json())
        await ctl.start()
        for rev in revisions:
            rkey = keys.report(NODE, NS, DEP, rev)
            await wait_for(lambda: isinstance(r := registration.report(rkey), AssignmentReport)
                           and r.state == AssignmentState.READY, TIMEOUT)
        assert set(ctl.served()[MODEL].revisions) == set(revisions)
        return ctl

    yield start
    for ctl in ctls:
        await ctl.stop()
    for m in core.models():
        await core.unload_model(m.model_id)


TMFactory = Callable[..., Awaitable[TrafficManager]]


@pytest.fixture
async def traffic(store: Store, keys: Keys, core: ServingCore,
                  registration: Registration) -> AsyncIterator[TMFactory]:
    """``await traffic(ctl, clock=..., reg=..., on_tm=..., crashes=...)``: a started
    TrafficManager wired as in node_agent.main (``reg``: its node's registration, default the
    fixture's; ``on_tm`` sees it before it starts; ``crashes`` replaces the core's crash
    counts), synced with the splits in the store."""
    tms: list[TrafficManager] = []

    async def start(ctl: Controller, *, clock: Callable[[], float] = time.time,
                    reg: Registration | None = None, on_tm=None,
                    crashes: Callable[[str, str], int] | None = None) -> TrafficManager:
        r = reg or registration
        tm = TrafficManager(store, keys, node_name=r.node_name, registration=r,
                            served=ctl.served, crashes=crashes or core.crashes,
                            memory_bytes=core.memory_bytes, clock=clock)
        if on_tm is not None:
            on_tm(tm)
        tms.append(tm)
        await tm.start()
        await asyncio.wait_for(tm.synced.wait(), TIMEOUT)
        return tm

    yield start
    for tm in tms:
        await tm.stop()


async def serve(tm: TrafficManager, core: ServingCore, key: str) -> Routed:
    """One request as the HTTP layer serves it: route, generate, record the outcome."""
    routed = tm.route(MODEL, session_header=key)
    assert routed is not None and not routed.route.forward
    t0 = time.perf_counter()
    first = last = None
    tokens, failed = 0, False
    gen = await core.generate(MODEL, revision=routed.route.revision, prompt="Hello",
                              max_tokens=3, temperature=0)
    try:
        async with gen:
            async for chunk in gen:
                last = time.perf_counter()
                first = first or last
                tokens = chunk.completion_tokens
    except GenerationAborted:
        failed = True
    tm.record(routed, latency_s=time.perf_counter() - t0,
              ttft_s=None if first is None else first - t0, completion_tokens=tokens,
              decode_seconds=None if first is None or last is None else last - first,
              failed=failed)
    return routed


def routes(tm: TrafficManager) -> dict[str, tuple[str, bool]]:
    """Session key → (revision, counted under a split) for every key of KEYS."""
    out = {}
    for k in KEYS:
        r = tm.route(MODEL, session_header=k)
        assert r is not None and not r.route.forward
        out[k] = (r.route.revision, r.route.canary)
    return out


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------


async def test_split_in_the_store_reaches_route(store: Store, keys: Keys, hold: Holder,
                                           traffic: TMFactory, tiny_model_path: Path,  # noqa: F811
                                           other_model_path: Path) -> None:  # noqa: F811
    ctl = await hold({"r1": (tiny_model_path, Role.STABLE),
                      "r2": (other_model_path, Role.CANDIDATE)})
    tm = await traffic(ctl)
    assert tm.route("nope") is None
    # no split: the stable revision, not counted
    assert set(routes(tm).values()) == {("r1", False)}

    await store.put(keys.traffic(NS, DEP), split(0).to_json())
    await wait_for(lambda: (NS, DEP) in tm.splits, TIMEOUT)
    assert set(routes(tm).values()) == {("r1", False)}          # weight 0: stable

    await store.put(keys.traffic(NS, DEP), split(30).to_json())
    await wait_for(lambda: tm.splits[(NS, DEP)].weight == 30, TIMEOUT)
    assert routes(tm) == {k: ("r2" if candidate_side(k, 30) else "r1", True) for k in KEYS}

    await store.put(keys.traffic(NS, DEP), split(100).to_json())
    await wait_for(lambda: tm.splits[(NS, DEP)].weight == 100, TIMEOUT)
    assert set(routes(tm).values()) == {("r2", True)}           # weight 100: candidate

    # a node that joins mid-canary (its traffic manager starts after the split was written)
    # routes by the current split as soon as it has synced, and reports for it at once
    reg2 = Registration(store, keys, node_name="mac-2", address="http://agent2.test:8000",
                        capacity=_capacity, ttl=5)
    await reg2.start()
    try:
        start = (await store.list(keys.root + "/")).revision + 1
        second = await traffic(ctl, reg=reg2)
        assert set(routes(second).values()) == {("r2", True)}
        watch = StatsWatch(store, keys.stats("mac-2", NS, DEP), start)
        try:
            await watch.until(lambda: len(watch.puts()) == 1)
            assert watch.puts()[0].canary_uid == "uid-1"
            assert watch.ours()[0].kv.lease == reg2.lease_id
        finally:
            await watch.close()
    finally:
        await second.stop()
        await reg2.stop()


async def test_statistics_under_the_lease_at_most_once_per_interval(
        store: Store, keys: Keys, core: ServingCore, registration: Registration,
        hold: Holder, traffic: TMFactory, monkeypatch: pytest.MonkeyPatch,
        tiny_model_path: Path, other_model_path: Path) -> None:  # noqa: F811
    monkeypatch.setattr(traffic_module, "WRITER_TICK_SECONDS", 0.01)  # many chances to write
    ctl = await hold({"r1": (tiny_model_path, Role.STABLE),
                      "r2": (other_model_path, Role.CANDIDATE)})
    clock = Clock()
    ticks: list[Ticks] = []
    earlier = {"r1": 2}  # serving-core crashes of r1 before the canary (cumulative since load)
    tm = await traffic(ctl, clock=clock, on_tm=lambda tm: ticks.append(Ticks(tm)),
                       crashes=lambda m, r: core.crashes(m, r) + earlier.get(r, 0))
    (tick,) = ticks
    skey = keys.stats(NODE, NS, DEP)
    watch = StatsWatch(store, skey, (await store.list(keys.root + "/")).revision + 1)
    try:
        # no split: outcomes are counted all the same (the fleet's request metrics): the first
        # write at once, then only when something new was counted and the idle interval passed
        await serve(tm, core, KEYS[0])
        await watch.until(lambda: len(watch.puts()) == 1)
        idle = watch.puts()[0]
        assert idle.canary_uid == "" and watch.ours()[0].kv.lease == registration.lease_id
        assert {r: (s.requests, s.crashes) for r, s in idle.revisions.items()} == {
            "r1": (1, 0), "r2": (0, 0)}  # the earlier crashes are not this epoch's
        for k in KEYS[1:3]:
            await serve(tm, core, k)                            # new, but not due
        await tick.passes(3)
        await watch.settle()
        assert len(watch.puts()) == 1
        clock.now += traffic_module.IDLE_STATS_INTERVAL_SECONDS
        await watch.until(lambda: len(watch.puts()) == 2)
        assert watch.puts()[1].revisions["r1"].requests == 3
        clock.now += traffic_module.IDLE_STATS_INTERVAL_SECONDS
        await tick.passes(3)                                    # due, but nothing new
        await watch.settle()
        assert len(watch.puts()) == 2
        n0 = 2

        # a split: a new epoch, its statistics written at once, then at most once per interval
        await store.put(keys.traffic(NS, DEP), split(50, interval=10.0).to_json())
        await watch.until(lambda: len(watch.puts()) == n0 + 1)
        first = watch.ours()[n0]
        assert first.kv.lease == registration.lease_id and keys.parse_stats(skey) == (
            NODE, NS, DEP)
        report = watch.puts()[n0]
        assert (report.node, report.namespace, report.name, report.canary_uid) == (
            NODE, NS, DEP, "uid-1")
        assert report.revisions["r1"].started_unix > idle.revisions["r1"].started_unix
        assert not report.guard_tripped and report.updated_unix == clock.now
        assert {r: (s.requests, s.errors, s.crashes) for r, s in report.revisions.items()} == {
            "r1": (0, 0, 0), "r2": (0, 0, 0)}   # the requests before and the earlier crashes
        assert all(s.memory_bytes > 0 for s in report.revisions.values())

        served = {"r1": 0, "r2": 0}
        for k in KEYS[:12]:
            served[(await serve(tm, core, k)).route.revision] += 1
        assert served["r1"] and served["r2"]
        await tick.passes(5)  # each pass would write the changed counters if it were due
        await watch.settle()
        assert len(watch.puts()) == n0 + 1

        earlier["r1"] += 1                                      # a crash during the canary
        clock.now += 10.0                                       # one interval later
        await watch.until(lambda: len(watch.puts()) == n0 + 2)
        report = watch.puts()[n0 + 1]
        assert report.updated_unix == clock.now
        assert {r: (s.requests, s.errors, s.crashes) for r, s in report.revisions.items()} == {
            r: (n, 0, int(r == "r1")) for r, n in served.items()}
        for s in report.revisions.values():
            assert sum(s.latency_seconds.counts) == s.requests == sum(s.ttft_seconds.counts)
            assert sum(s.tokens_per_second.counts) == s.requests  # 3 tokens each
        assert watch.ours()[-1].kv.lease == registration.lease_id

        clock.now += 5.0                                        # half an interval: not due
        await serve(tm, core, KEYS[0])
        await tick.passes(5)
        await watch.settle()
        assert len(watch.puts()) == n0 + 2

        # the split goes away: the canary's statistics key too, and routing returns to stable
        under_split = tm.route(MODEL, session_header=KEYS[0])
        assert under_split is not None and under_split.route.canary
        await store.delete(keys.traffic(NS, DEP))
        await watch.until(lambda: watch.ours()[-1].type == "DELETE")
        assert set(routes(tm).values()) == {("r1", False)}
        tm.record(under_split, latency_s=0.1, ttft_s=0.01, completion_tokens=3,
                  decode_seconds=0.05, failed=False)            # its epoch is gone: not counted
        clock.now += 60.0
        await tick.passes(5)
        await watch.settle()
        assert [e.type for e in watch.ours()] == ["PUT"] * (n0 + 2) + ["DELETE"]
        assert await store.get(skey) is None

        # requests after the canary count in a new epoch; once the node serves the deployment
        # no more, its statistics key goes
        await serve(tm, core, KEYS[1])
        await watch.until(lambda: watch.ours()[-1].type == "PUT")
        after = watch.puts()[-1]
        assert after.canary_uid == "" and after.revisions["r1"].requests == 1
        for rev in ("r1", "r2"):
            await store.delete(keys.assignment(NODE, NS, DEP, rev))
        await wait_for(lambda: MODEL not in ctl.served(), TIMEOUT)
        await watch.until(lambda: watch.ours()[-1].type == "DELETE")
        assert await store.get(skey) is None
    finally:
        await watch.close()


async def test_guard_trips_on_candidate_failures_and_reports_at_once(
        store: Store, keys: Keys, core: ServingCore, registration: Registration,
        hold: Holder, traffic: TMFactory,
        tiny_model_path: Path, faulty_model_path: Path) -> None:  # noqa: F811
    ctl = await hold({"r1": (tiny_model_path, Role.STABLE),
                      "bad": (faulty_model_path, Role.CANDIDATE)})
    clock = Clock()
    guard = LocalGuard(window_seconds=60, min_failures=3, failure_ratio=0.5)
    await store.put(keys.traffic(NS, DEP),
                    split(100, candidate="bad", interval=3600, guard=guard).to_json())
    tm = await traffic(ctl, clock=clock)
    skey = keys.stats(NODE, NS, DEP)
    watch = StatsWatch(store, skey, (await store.list(keys.root + "/")).revision + 1)
    try:
        await watch.until(lambda: len(watch.puts()) == 1)      # the first write, at once
        assert not watch.puts()[0].guard_tripped

        for k in KEYS[:2]:                                      # below the threshold
            assert (await serve(tm, core, k)).route.revision == "bad"
        assert set(routes(tm).values()) == {("bad", True)}
        await watch.settle()
        assert len(watch.puts()) == 1                           # nothing due, nothing tripped

        await serve(tm, core, KEYS[2])                          # the third failure trips it
        await watch.until(lambda: len(watch.puts()) == 2)
        report = watch.puts()[1]
        assert report.guard_tripped and report.updated_unix == clock.now  # not an interval
        assert "candidate bad: 3 of 3 requests failed" in report.guard_reason
        assert (report.revisions["bad"].requests, report.revisions["bad"].errors) == (3, 3)
        assert watch.ours()[-1].kv.lease == registration.lease_id
        # every key now goes to the stable revision (still counted under the split)
        assert set(routes(tm).values()) == {("r1", True)}
        for k in KEYS[3:6]:
            assert (await serve(tm, core, k)).route.revision == "r1"

        # the split goes away: stats key deleted, plain stable routing
        await store.delete(keys.traffic(NS, DEP))
        await watch.until(lambda: watch.ours()[-1].type == "DELETE")
        assert set(routes(tm).values()) == {("r1", False)}
    finally:
        await watch.close()
