"""The agent's convergence decisions (node_agent.convergence.step), table-driven over plain
records: no etcd, no MLX, no event loop. Every lifecycle edge of an assignment: a new one,
a download failure and its back-off, the resume when the retry is due, a changed or withdrawn
assignment mid-load, a bug in one key's task, a served name held by another deployment,
OnDemand, eviction under memory pressure and the model limit, pinned / in-flight / busy
protection, idle unload, reload on demand, predictive prefetch, drain and retirement."""

from __future__ import annotations

import pytest

from mlx_fleet.capabilities import ModelCapabilities
from mlx_fleet.contract import (AWAITING_REQUEST, EVICTED, IDLE_UNLOADED, Assignment,
                                AssignmentReport, AssignmentState, DownloadProgress,
                                LifecyclePolicy, ModelSource, Role)
from node_agent.convergence import step
from node_agent.convergence.state import (INSUFFICIENT_MEMORY, MODEL_LIMIT, Failure, IdleUnload,
                                          Invalid, Loaded, Record, ServedModel, Spec,
                                          StandbyModel)
from node_agent.lifecycle import ModelUse, UsageHistory, idle_unloads

A = step.Action
GiB = 2**30


class Held:
    """A lock held by someone else (the key is busy: a load, an unload or a reload runs)."""

    def locked(self) -> bool:
        return True


class Busy:
    """A key's running task, as the decisions see it (only whether there is one)."""


def assignment(name: str = "chat", *, model: str | None = None, uri: str = "file:///m/a",
               revision: str = "r1", generation: int = 1, idle: int = 300,
               pinned: bool = False, prefetch: str = "Eager", ns: str = "default",
               role: Role = Role.STABLE) -> Assignment:
    return Assignment(namespace=ns, name=name, generation=generation,
                      served_model_name=model or name, role=role,
                      source=ModelSource(uri=uri, revision=revision), memory_bytes=GiB,
                      lifecycle=LifecyclePolicy(idle_unload_seconds=idle, pinned=pinned,
                                                prefetch=prefetch))


def key_of(a: Assignment) -> str:
    return f"/k/{a.namespace}/{a.name}/{a.revision}"


def loaded(a: Assignment, *, last_used: float = 0.0, standby: bool = False,
           estimate: int = GiB, load_seconds: float = 0.0, **kw) -> Loaded:
    return Loaded(Spec.of(a), resident_bytes=estimate // 2, last_used=last_used,
                  standby=standby, estimated_bytes=estimate, load_seconds=load_seconds, **kw)


def record(a: Assignment | Invalid | None, *, deployment: tuple[str, str] | None = None,
           **kw) -> Record:
    if deployment is None:
        deployment = (a.namespace, a.name) if a is not None else ("default", "gone")
    return Record(deployment=deployment, desired=a, **kw)


def failure(a: Assignment, *, attempts: int = 1, retry_at: float | None = 10.0,
            reason: str = "ModelNotFound") -> Failure:
    return Failure(Spec.of(a), reason, f"{reason} (attempt {attempts})", attempts, retry_at,
                   estimated_bytes=GiB)


# -------------------------------------------------------------------------------------------
# the converge worker's plan: which keys' tasks to cancel and start, and when to wake
# -------------------------------------------------------------------------------------------

a1 = assignment()
a1_gen2 = assignment(generation=2)
a1_moved = assignment(uri="file:///m/b")  # the same key, another source: a reload
busy = Busy()

PLAN_CASES = [
    ("a new assignment: start", record(a1), 0, [], ["k"], None),
    ("converged: nothing", record(a1, done=a1), 0, [], [], None),
    ("a new generation, same spec: start (re-report)", record(a1_gen2, done=a1), 0, [],
     ["k"], None),
    ("changed mid-load: cancel and restart",
     record(a1_moved, task=busy, running=Spec.of(a1)), 0, ["k"], ["k"], None),
    ("withdrawn mid-load: cancel and retire",
     record(None, deployment=("default", "chat"), task=busy, running=Spec.of(a1)), 0, ["k"],
     ["k"], None),
    ("withdrawn, something left (a report): retire",
     record(None, reported=True), 0, [], ["k"], None),
    ("withdrawn, something left (standby): retire",
     record(None, loaded=loaded(a1, standby=True)), 0, [], ["k"], None),
    ("withdrawn, nothing left: nothing", record(None), 0, [], [], None),
    ("a download failed, its retry to come: wake then",
     record(a1, done=a1, failure=failure(a1, retry_at=10)), 5, [], [], 10),
    ("the retry is due: start (resume)",
     record(a1, done=a1, failure=failure(a1, retry_at=10)), 10, [], ["k"], None),
    ("a permanent failure: never retried",
     record(a1, done=a1, failure=failure(a1, retry_at=None, reason="InvalidSource")), 1e9,
     [], [], None),
    ("a failure of the previous spec: the new spec starts at once",
     record(a1_moved, done=a1, failure=failure(a1, retry_at=1e9)), 0, [], ["k"], None),
    ("a bug in the key's task (ended, converged to nothing): start again",
     record(a1, done=None), 0, [], ["k"], None),
]


@pytest.mark.parametrize("rec, now, cancel, start, wake_at", [c[1:] for c in PLAN_CASES],
                         ids=[c[0] for c in PLAN_CASES])
def test_plan(rec: Record, now: float, cancel: list[str], start: list[str],
              wake_at: float | None) -> None:
    assert step.plan({"k": rec}, now) == step.ConvergePlan(tuple(cancel), tuple(start),
                                                          wake_at)


def test_a_bug_or_a_slow_download_in_one_key_never_holds_up_the_others() -> None:
    b = assignment("b")
    records = {"bugged": record(a1, done=None),                   # its task raised
               "slow": record(b, task=busy, running=Spec.of(b)),   # downloading
               "new": record(assignment("c"))}
    plan = step.plan(records, 0)
    assert plan.start == ("bugged", "new") and plan.cancel == ()


# -------------------------------------------------------------------------------------------
# one key's task
# -------------------------------------------------------------------------------------------

other_dep = assignment("other", model="chat")  # another deployment, the same served name
renamed = assignment(model="chat-v2")           # the same key, served under another name
on_demand = assignment(prefetch="OnDemand")


def converge_case(rec: Record, *, d=None, others: dict[str, Record] | None = None,
                  now: float = 0.0, draining=()) -> step.Converge:
    records = {"k": rec, **(others or {})}
    return step.converge("k", d if d is not None else rec.desired, records, now,
                         draining=draining)


CONVERGE_CASES = [
    ("invalid: Failed/InvalidAssignment",
     record(Invalid("default", "chat", 3, "bad")), {}, 0,
     step.Converge(A.REPORT_INVALID)),
    ("new: load", record(a1), {}, 0, step.Converge(A.LOAD)),
    ("loaded, generation moved: report it", record(a1_gen2, loaded=loaded(a1)), {}, 0,
     step.Converge(A.REPORT_LOADED)),
    ("standby, generation moved: report standby (no reload)",
     record(a1_gen2, loaded=loaded(a1, standby=True)), {}, 0,
     step.Converge(A.REPORT_LOADED)),
    ("renamed: let the old name go, load the new",
     record(renamed, loaded=loaded(a1)), {}, 0, step.Converge(A.LOAD, let_go=True)),
    ("failed, retry to come: Failed again (the generation follows)",
     record(a1_gen2, failure=failure(a1, retry_at=10)), {}, 5,
     step.Converge(A.REPORT_FAILED, failure=failure(a1, retry_at=10))),
    ("failed, retry due: load, retrying that failure",
     record(a1, failure=failure(a1, retry_at=10)), {}, 10,
     step.Converge(A.LOAD, failure=failure(a1, retry_at=10))),
    ("failed permanently: Failed again, never loaded",
     record(a1, failure=failure(a1, retry_at=None, reason="UnsupportedSource")), {}, 1e9,
     step.Converge(A.REPORT_FAILED,
                   failure=failure(a1, retry_at=None, reason="UnsupportedSource"))),
    ("failed, then the source changed: load the new spec at once, attempts start over",
     record(a1_moved, failure=failure(a1, retry_at=1e9)), {}, 0, step.Converge(A.LOAD)),
    ("the name is another deployment's (loaded): ModelNameConflict",
     record(a1), {"o": record(other_dep, loaded=loaded(other_dep))}, 0,
     step.Converge(A.REPORT_CONFLICT, owner="o")),
    ("the name is another deployment's (being loaded): ModelNameConflict",
     record(a1), {"o": record(other_dep, claim="chat")}, 0,
     step.Converge(A.REPORT_CONFLICT, owner="o")),
    ("the name is this deployment's other revision: no conflict (surge, canary)",
     record(a1), {"r2": record(assignment(revision="r2"),
                               loaded=loaded(assignment(revision="r2")))}, 0,
     step.Converge(A.LOAD)),
    ("OnDemand: standby until the first request", record(on_demand), {}, 0,
     step.Converge(A.AWAIT_REQUEST)),
    ("OnDemand, failed and due: load (a retry is a load)",
     record(on_demand, failure=failure(on_demand, retry_at=1)), {}, 1,
     step.Converge(A.LOAD, failure=failure(on_demand, retry_at=1))),
    ("an earlier attempt under another name: its series are forgotten",
     record(renamed, attempted=Spec.of(a1)), {}, 0,
     step.Converge(A.LOAD, forget=Spec.of(a1))),
]


@pytest.mark.parametrize("rec, others, now, expected", [c[1:] for c in CONVERGE_CASES],
                         ids=[c[0] for c in CONVERGE_CASES])
def test_converge(rec: Record, others: dict[str, Record], now: float,
                  expected: step.Converge) -> None:
    assert converge_case(rec, others=others, now=now) == expected


def test_an_earlier_attempt_that_drains_is_forgotten_by_its_drain() -> None:
    rec = record(renamed, attempted=Spec.of(a1))
    assert converge_case(rec, draining=[Spec.of(a1).ident]).forget is None
    # renamed while loaded: the let-go drains it, and the drain forgets it
    rec = record(renamed, loaded=loaded(a1), attempted=Spec.of(a1))
    assert converge_case(rec) == step.Converge(A.LOAD, let_go=True)


def test_the_task_converges_to_the_value_it_started_for() -> None:
    # the key changed generation after the task started: it reports what it started with,
    # and the plan starts it again afterwards (desired != done)
    rec = record(a1_gen2, loaded=loaded(a1))
    assert converge_case(rec, d=a1) == step.Converge(A.REPORT_LOADED)
    rec.done = a1
    assert step.plan({"k": rec}, 0).start == ("k",)


OPENING_CASES = [
    ("a first load of a local source: Loading", False, False, False, step.Opening.LOADING),
    ("a first load of a remote source: Prefetching", False, False, True,
     step.Opening.PREFETCHING),
    ("a retry (a resume): stays Failed", False, True, True, step.Opening.QUIET),
    ("a retry of a local source: stays Failed", False, True, False, step.Opening.QUIET),
    ("a reload on demand / prefetch: Loading with its reason", True, False, True,
     step.Opening.RELOADING),
]


@pytest.mark.parametrize("on_demand, retried, remote, expected", [c[1:] for c in OPENING_CASES],
                         ids=[c[0] for c in OPENING_CASES])
def test_opening(on_demand: bool, retried: bool, remote: bool, expected: step.Opening) -> None:
    assert step.opening(on_demand=on_demand, retried=retried, remote=remote) is expected


def test_a_resumed_download_shows_progress_only_once_bytes_flow() -> None:
    idle, flowing = DownloadProgress(bytes_done=10), DownloadProgress(
        bytes_done=10, rate_bytes_per_second=5.0)
    assert not step.shows_progress(False, idle) and step.shows_progress(False, flowing)
    assert step.shows_progress(True, idle)


def test_known_estimate_comes_from_the_last_load_or_attempt_of_the_same_spec() -> None:
    assert step.known_estimate(record(a1), Spec.of(a1)) == 0
    assert step.known_estimate(record(a1, loaded=loaded(a1, estimate=3)), Spec.of(a1)) == 3
    assert step.known_estimate(record(a1, loaded=loaded(a1, estimate=3)),
                               Spec.of(a1_moved)) == 0
    assert step.known_estimate(record(a1, failure=failure(a1)), Spec.of(a1)) == GiB
    assert step.known_estimate(record(a1, failure=failure(a1)), Spec.of(a1_moved)) == 0


# -------------------------------------------------------------------------------------------
# a failure's back-off
# -------------------------------------------------------------------------------------------


def test_failed_backs_off_exponentially_to_the_cap() -> None:
    spec, f, delays = Spec.of(a1), None, []
    for n in range(1, 10):
        f = step.failed(f, spec, "ModelNotFound", "no model", now=100.0, backoff=(2.0, 300.0),
                        estimated_bytes=7)
        assert f.attempts == n and f.estimated_bytes == 7
        assert f.retry_at is not None
        delays.append(f.retry_at - 100.0)
    assert delays == [2, 4, 8, 16, 32, 64, 128, 256, 300]
    assert f.message == "no model (attempt 9; retrying in 300s)"


def test_failed_starts_over_for_a_new_spec_and_never_retries_a_permanent_reason() -> None:
    first = step.failed(None, Spec.of(a1), "LoadFailed", "oom", 0, backoff=(2.0, 300.0))
    again = step.failed(first, Spec.of(a1_moved), "LoadFailed", "oom", 50, backoff=(2.0, 300.0))
    assert (again.attempts, again.retry_at) == (1, 52.0)
    for reason in ("InvalidSource", "UnsupportedSource", "InvalidAssignment"):
        f = step.failed(first, Spec.of(a1), reason, "wrong uri", 0, backoff=(2.0, 300.0))
        assert f.retry_at is None and f.message == "wrong uri" and f.attempts == 2


# -------------------------------------------------------------------------------------------
# memory, the model limit and eviction
# -------------------------------------------------------------------------------------------

a, b, c = (assignment(n, uri=f"file:///m/{n}") for n in "abc")


def test_in_use_counts_resident_draining_and_loading_revisions() -> None:
    records = {"a": record(a, loaded=loaded(a, estimate=3 * GiB)),           # resident
               "b": record(b, loaded=loaded(b, standby=True, estimate=GiB)),  # standby: none
               "c": record(c, loading=(Spec.of(c), 2 * GiB))}                 # being loaded
    core = step.CoreView({Spec.of(a).ident: 4 * GiB, ("old", "r0"): GiB},    # old: draining
                         frozenset({Spec.of(a).ident}))
    assert step.in_use(records, core) == (4 * GiB + GiB + 2 * GiB, {"a": 4 * GiB})
    assert step.in_use(records, core, exclude="c") == (5 * GiB, {"a": 4 * GiB})
    assert step.in_use(records, core, exclude="a") == (GiB + 2 * GiB, {})
    assert step.resident_count(records, core, Spec.of(c).ident) == 2
    assert step.resident_count(records, core, ("x", "r1")) == 3


def uses_of(*items: tuple[str, float], in_flight=(), pinned=()) -> tuple[ModelUse, ...]:
    return tuple(ModelUse(k, t, 1 if k in in_flight else 0, 300, pinned=k in pinned,
                          resident_bytes=2 * GiB) for k, t in items)


def obs(*, budget: int | None = 10 * GiB, limit: int = 0, need: int = 2 * GiB,
        used: int = 6 * GiB, resident: int = 3, uses=()) -> step.RoomObservation:
    return step.RoomObservation(budget, limit, need, used, {u.key: 2 * GiB for u in uses},
                                resident, tuple(uses))


ROOM_CASES = [
    ("no budget, no limit: fits", obs(budget=None, used=10**15), True, False,
     step.Room()),
    ("fits the budget", obs(), True, False, step.Room()),
    ("memory pressure: evict the least recently used idle revision",
     obs(need=5 * GiB, uses=uses_of(("x", 5), ("y", 1), ("z", 9))), True, False,
     step.Room(evict=("y",), cause="m revision r1 (needs 5.0GiB; 4.0GiB free of the node's "
                                    "budget 10.0GiB)")),
    ("memory pressure: two evicted, oldest first",
     obs(need=7 * GiB, uses=uses_of(("x", 5), ("y", 1), ("z", 9))), True, False,
     step.Room(evict=("y", "x"), cause="m revision r1 (needs 7.0GiB; 4.0GiB free of the node's "
                                       "budget 10.0GiB)")),
    ("pinned and in-flight revisions are never evicted",
     obs(need=5 * GiB, uses=uses_of(("x", 5), ("y", 1), in_flight={"y"}, pinned={"x"})),
     True, False, "refuse:" + INSUFFICIENT_MEMORY),
    ("the model limit: evict one", obs(budget=None, limit=2, resident=2,
                                       uses=uses_of(("x", 5), ("y", 1))), True, False,
     step.Room(evict=("y",), cause="m revision r1 (2 of the node's limit of 2 loaded models "
                                   "(--max-loaded-models) are resident)")),
    ("the model limit, the resident one pinned: ModelLimit",
     obs(budget=None, limit=1, resident=1, uses=uses_of(("x", 5), pinned={"x"})), True,
     False, "refuse:" + MODEL_LIMIT),
    ("a prefetch never evicts", obs(need=5 * GiB, uses=uses_of(("y", 1))), False, False,
     "refuse:" + INSUFFICIENT_MEMORY),
    ("evicted, still not enough: refused", obs(need=5 * GiB, uses=uses_of(("y", 1))), True,
     True, "refuse:" + INSUFFICIENT_MEMORY),
    ("evicted, now it fits", obs(used=2 * GiB), True, True, step.Room()),
]


@pytest.mark.parametrize("observation, evict, evicted, expected", [c[1:] for c in ROOM_CASES],
                         ids=[c[0] for c in ROOM_CASES])
def test_room(observation: step.RoomObservation, evict: bool, evicted: bool,
              expected) -> None:
    spec = Spec("m", "file:///m", "r1", 4, 4096)
    got = step.room(spec, observation, 100.0, evict=evict, evicted=evicted)
    if isinstance(expected, str):
        assert got.refuse == expected.split(":")[1] and not got.evict
    else:
        assert got == expected


def test_room_messages_give_the_numbers() -> None:
    spec = Spec("m", "file:///m", "r1", 4, 4096)
    memory = step.room(spec, obs(need=5 * GiB, uses=uses_of(("y", 1), pinned={"y"})), 0,
                       evict=True)
    assert memory.message == (
        "m revision r1 needs 5.0GiB (5368709120 bytes) but only 4.0GiB of the node's budget "
        "10.0GiB is free: 6.0GiB is held by 1 resident revision(s) that cannot be evicted "
        "(pinned by minReady, serving requests or busy)")
    limit = step.room(spec, obs(budget=None, limit=1, resident=1), 0, evict=False)
    assert limit.message == (
        "m revision r1 would be loaded model 2 but the node's limit is 1 "
        "(--max-loaded-models): 1 revision(s) are resident or loading that a prefetch does "
        "not evict")
    # both fail; evicting y would satisfy memory, but a draining revision keeps the count
    # over the limit: the limit is what fails
    both = step.room(spec, obs(need=5 * GiB, limit=1, resident=2, uses=uses_of(("y", 1))),
                     100, evict=True)
    assert both.refuse == MODEL_LIMIT
    # the same with y serving: memory cannot be met either, so memory is what fails
    both = step.room(spec, obs(need=5 * GiB, limit=1, resident=2,
                               uses=uses_of(("y", 1), in_flight={"y"})), 100, evict=True)
    assert both.refuse == INSUFFICIENT_MEMORY


# -------------------------------------------------------------------------------------------
# idle unload, pinned / in-flight / busy protection
# -------------------------------------------------------------------------------------------


def test_model_uses_protect_busy_in_flight_and_pinned_revisions() -> None:
    pinned = assignment("p", uri="file:///m/p", pinned=True)
    records = {"a": record(a, loaded=loaded(a, last_used=10)),
               "b": record(b, loaded=loaded(b, last_used=20)),
               "c": record(c, loaded=loaded(c, last_used=30), lock=Held()),   # busy
               "p": record(pinned, loaded=loaded(pinned, last_used=0)),
               "moved": record(a1_moved, loaded=loaded(a1, last_used=0))}     # reassigned
    held = {k: GiB for k in records}
    uses = step.model_uses(records, held, {Spec.of(b).ident: 2}, now=1000)
    assert set(uses) == {"a", "b", "p"}
    assert (uses["b"].last_used, uses["b"].in_flight) == (1000, 2)  # in flight: used now
    assert uses["p"].pinned and uses["a"].resident_bytes == GiB
    assert idle_unloads(uses.values(), 1000) == ["a"]  # b serving, p pinned


IDLE_CASES = [
    ("idle long enough", dict(), IDLE_UNLOADED, 0, 400, True),
    ("not idle long enough yet", dict(), IDLE_UNLOADED, 0, 299, False),
    ("idleUnloadSeconds 0: never", dict(idle=0), IDLE_UNLOADED, 0, 10**9, False),
    ("pinned (minReady)", dict(pinned=True), IDLE_UNLOADED, 0, 400, False),
    ("pinned: not evicted either", dict(pinned=True), EVICTED, 0, 400, False),
    ("a request in flight", dict(), IDLE_UNLOADED, 1, 400, False),
    ("evicted: no idleness needed", dict(), EVICTED, 0, 1, True),
]


@pytest.mark.parametrize("policy, reason, in_flight, now, expected", [c[1:] for c in IDLE_CASES],
                         ids=[c[0] for c in IDLE_CASES])
def test_may_unload(policy: dict, reason: str, in_flight: int, now: float,
                    expected: bool) -> None:
    d = assignment(**policy)
    held = loaded(d, last_used=0)
    rec = record(d, loaded=held)
    assert (step.may_unload(rec, held, reason, in_flight, now) == d) is expected


def test_may_unload_refuses_a_revision_reassigned_or_replaced_meanwhile() -> None:
    held = loaded(a1)
    assert step.may_unload(record(a1_moved, loaded=held), held, EVICTED, 0, 1e9) is None
    assert step.may_unload(record(None, loaded=held), held, EVICTED, 0, 1e9) is None
    assert step.may_unload(record(a1, loaded=loaded(a1)), held, EVICTED, 0, 1e9) is None


# -------------------------------------------------------------------------------------------
# predictive prefetch and reload on demand
# -------------------------------------------------------------------------------------------


def periodic(*idents: tuple[str, str]) -> UsageHistory:
    h = UsageHistory()
    for ident in idents:
        for t in (0, 120, 240, 360):  # a request every 120 s: the next one at 480
            h.record(ident, t)
    return h


def prefetch_case(records, history, now=455, *, budget=None, limit=0, allowance=2,
                  reloading=(), core=step.CoreView()):
    return step.prefetches(records, history, now, core=core, reloading=reloading,
                           allowance=allowance, window_s=30, budget_bytes=budget,
                           max_loaded_models=limit)


def test_prefetch_starts_a_periodic_standby_revision_within_the_window() -> None:
    records = {"a": record(a, loaded=loaded(a, standby=True)),
               "b": record(b, loaded=loaded(b, standby=True))}
    history = periodic(Spec.of(a).ident)
    assert prefetch_case(records, history, now=421) == ([], [])  # 480 is beyond 30 s
    assert prefetch_case(records, history) == ([("a", Spec.of(a).ident)], [])
    assert prefetch_case(records, history, allowance=0) == ([], [])
    assert prefetch_case(records, history, reloading=[Spec.of(a).ident]) == ([], [])
    records["a"].lock = Held()  # its key is busy
    assert prefetch_case(records, history) == ([], [])


def test_prefetch_never_evicts_for_the_budget_or_the_limit() -> None:
    records = {"a": record(a, loaded=loaded(a, standby=True, estimate=4 * GiB)),
               "b": record(b, loaded=loaded(b, standby=True, estimate=4 * GiB)),
               "c": record(c, loaded=loaded(c, estimate=GiB))}
    core = step.CoreView({Spec.of(c).ident: GiB}, frozenset({Spec.of(c).ident}))
    history = periodic(Spec.of(a).ident, Spec.of(b).ident)
    started, skipped = prefetch_case(records, history, budget=6 * GiB, core=core)
    assert started == [("a", Spec.of(a).ident)]  # b would not fit beside a: reserved
    assert [i for i, _ in skipped] == [Spec.of(b).ident]
    assert "does not fit the 1.0GiB free" in skipped[0][1]
    started, skipped = prefetch_case(records, history, limit=1, core=core)
    assert started == [] and "limit of 1 loaded models" in skipped[0][1]


ADMIT_CASES = [
    ("resident: go on", dict(standby=False), True, False, 0, step.Admit(step.Admission.READY,
                                                                       "k")),
    ("standby: start its reload", dict(standby=True), False, False, 0,
     step.Admit(step.Admission.START, "k")),
    ("its reload runs: wait for it", dict(standby=True), False, True, 5,
     step.Admit(step.Admission.JOIN)),
    ("too many wait: 429 after the last load's duration",
     dict(standby=True, load_seconds=2.2), False, True, 32,
     step.Admit(step.Admission.OVERLOADED, retry_after=3)),
    ("too many wait, a fast load: at least 1 s", dict(standby=True), False, False, 32,
     step.Admit(step.Admission.OVERLOADED, retry_after=1)),
    ("loaded but not serving (draining): not served", dict(standby=False), False, False, 0,
     step.Admit(step.Admission.NOT_SERVED)),
]


@pytest.mark.parametrize("held, serving, reloading, waiting, expected",
                         [c[1:] for c in ADMIT_CASES], ids=[c[0] for c in ADMIT_CASES])
def test_admit(held: dict, serving: bool, reloading: bool, waiting: int,
               expected: step.Admit) -> None:
    records = {"k": record(a1, loaded=loaded(a1, **held))}
    assert step.admit(records, Spec.of(a1).ident, serving=serving, reloading=reloading,
                      waiting=waiting, max_waiters=32) == expected


def test_admit_a_revision_not_served_here() -> None:
    assert step.admit({}, ("nope", "r1"), serving=False, reloading=False, waiting=0,
                      max_waiters=32) == step.Admit(step.Admission.NOT_SERVED)


# -------------------------------------------------------------------------------------------
# drain, retirement and the views
# -------------------------------------------------------------------------------------------


def test_retire_drains_what_is_loaded_and_deletes_the_report() -> None:
    held = loaded(a1)
    rec = record(None, loaded=held, attempted=Spec.of(a1), reported=True)
    # the drain of what it let go forgets its series once done, not now
    assert step.retire(rec, draining=[]) == step.Retire(held, None, True)
    standby = loaded(a1, standby=True)  # nothing to drain: forgotten at once
    rec = record(None, loaded=standby, attempted=Spec.of(a1))
    assert step.retire(rec, draining=[]) == step.Retire(standby, Spec.of(a1), True)
    # a cancelled download of another spec: its series go
    rec = record(None, attempted=Spec.of(a1_moved), reported=True)
    assert step.retire(rec, draining=[]) == step.Retire(None, Spec.of(a1_moved), True)
    assert step.retire(rec, draining=[Spec.of(a1_moved).ident]).forget is None
    assert step.retire(record(None), draining=[]) == step.Retire(None, None, False)


def test_holds_keeps_a_revision_assigned_again() -> None:
    records = {"k": record(a1, loaded=loaded(a1, standby=True))}
    assert step.holds(records, Spec.of(a1).ident) and not step.holds(records, ("x", "r1"))


CAPS = ModelCapabilities(max_n=2, max_context_tokens=4096)


def test_served_and_standby_views() -> None:
    unload = IdleUnload("a", "r1", 400, 300, None, None, 0, reason=EVICTED)
    r2 = assignment("a", uri="file:///m/a2", revision="r2", role=Role.CANDIDATE)
    a_r1 = assignment("a", uri="file:///m/a")
    lazy = assignment("lazy", prefetch="OnDemand")
    records = {
        "a1": record(a_r1, loaded=loaded(a_r1, standby=True, unload=unload, created_unix=5,
                                         capabilities=CAPS)),
        "a2": record(r2, loaded=loaded(r2)),
        "lazy": record(lazy, loaded=loaded(lazy, standby=True, estimate=0,
                                           standby_reason=AWAITING_REQUEST, created_unix=7)),
        "gone": record(None, loaded=loaded(assignment("gone"))),  # retiring: not served
    }
    assert step.served(records) == {
        "a": ServedModel("default", "a", {"r1": Role.STABLE, "r2": Role.CANDIDATE},
                         frozenset({"r1"})),
        "lazy": ServedModel("default", "lazy", {"r1": Role.STABLE}, frozenset({"r1"}))}
    assert step.standby_models(records) == [
        StandbyModel("a", "r1", 4096, EVICTED, 5, CAPS),    # its last load's capabilities
        StandbyModel("lazy", "r1", 4096, AWAITING_REQUEST, 7)]   # never loaded: unknown


def test_a_record_is_forgettable_once_nothing_is_left() -> None:
    rec = record(None)
    assert rec.forgettable()
    report = AssignmentReport(node="n", namespace="default", name="chat", generation=1,
                              state=AssignmentState.READY)
    assert record(a1, report=report).phase == AssignmentState.READY
    assert record(a1).phase == AssignmentState.PENDING
    for field, value in [("reported", True), ("failure", failure(a1)), ("claim", "chat"),
                         ("report", report),
                         ("loaded", loaded(a1)), ("lock", Held()), ("task", busy)]:
        assert not record(None, **{field: value}).forgettable(), field
