"""AssignmentsView: the operator's in-memory assignments, fed by a follower and its own commits.
Pure: table-driven, no etcd."""

from __future__ import annotations

import pytest

from mlx_fleet.store import KV, Delete, Put, WatchEvent
from mlx_fleet_operator.view import AssignmentsView

P = "/r/assignments/"


def kv(name: str, rev: int, value: bytes = b"v") -> KV:
    return KV(P + name, value, mod_revision=rev)


def put(name: str, rev: int, value: bytes = b"v") -> WatchEvent:
    return WatchEvent("PUT", kv(name, rev, value))


def delete(name: str, rev: int) -> WatchEvent:
    return WatchEvent("DELETE", KV(P + name, b"", mod_revision=rev))


def state(v: AssignmentsView) -> dict[str, tuple[bytes, int]]:
    return {k.key[len(P):]: (k.value, k.mod_revision) for k in v.items()}


def test_empty_view_covers_nothing_until_loaded():
    v = AssignmentsView()
    assert not v.covers(0) and not v.covers(5)
    v.reset([], 7)
    assert v.covers(0) and v.covers(7) and not v.covers(8)


@pytest.mark.parametrize(("steps", "want", "complete"), [
    # a listing, then later events: applied; complete up to the revision before the last event
    ([("reset", [kv("a", 3)], 5), put("b", 6), put("a", 8, b"w")],
     {"a": (b"w", 8), "b": (b"v", 6)}, 7),
    # events the listing already holds (≤ its revision) are ignored
    ([("reset", [kv("a", 3)], 5), delete("a", 4), put("c", 5)], {"a": (b"v", 3)}, 5),
    # a delete after the listing removes the key
    ([("reset", [kv("a", 3)], 5), delete("a", 9)], {}, 8),
    # a listing older than what the view is complete through is ignored
    ([("reset", [kv("a", 3)], 5), ("commit", [Put(P + "b", b"x")], 10), ("reset", [], 8)],
     {"a": (b"v", 3), "b": (b"x", 10)}, 10),
    # our own put, then the watch delivers it (same revision) and an older put of that key
    ([("reset", [kv("a", 3)], 5), ("commit", [Put(P + "a", b"new")], 10), put("a", 6, b"old"),
      put("a", 10, b"new")], {"a": (b"new", 10)}, 10),
    # our own delete: an older put delivered late does not bring the key back
    ([("reset", [], 5), put("a", 6), ("commit", [Delete(P + "a")], 10), put("a", 6)], {}, 10),
    # ... and it comes back when re-created after our delete
    ([("reset", [], 5), ("commit", [Delete(P + "a")], 10), put("a", 12, b"again")],
     {"a": (b"again", 12)}, 11),
    # keys outside the prefix (the epoch bump of the same transaction) are not assignments
    ([("reset", [], 5), ("commit", [Put("/r/placement-epoch", b"1"), Put(P + "a", b"x")], 6)],
     {"a": (b"x", 6)}, 6),
])
def test_view_steps(steps, want, complete):
    v = AssignmentsView()
    for step in steps:
        if isinstance(step, WatchEvent):
            v.apply(step)
        elif step[0] == "reset":
            v.reset(step[1], step[2])
        else:
            v.committed(step[1], step[2], P)
    assert state(v) == want
    assert v.complete == complete


def test_changes_counts_only_real_changes():
    v = AssignmentsView()
    v.reset([kv("a", 3)], 5)
    before = v.changes
    v.apply(put("a", 4))  # in the listing already
    v.apply(delete("zz", 9))  # not there
    assert v.changes == before
    v.apply(put("b", 10))
    assert v.changes == before + 1


def test_a_transaction_seen_in_part_is_not_complete():
    """A transaction's events share one revision and arrive one by one: after the first, the
    view covers only the revisions before it."""
    v = AssignmentsView()
    v.reset([], 5)
    v.apply(put("a", 9))
    assert v.covers(8) and not v.covers(9)
