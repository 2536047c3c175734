"""tests/xdist_order.py: under pytest-xdist the files with fault tests go first, the one with the
most first; nothing else moves, and a run without workers keeps pytest's order. Pure."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from xdist_order import pytest_collection_modifyitems


class Item:
    def __init__(self, path: str, name: str, fault: bool = False) -> None:
        self.path, self.name, self.fault = Path(path), name, fault

    def get_closest_marker(self, name: str):
        return object() if name == "fault" and self.fault else None


def collection() -> list[Item]:
    return [Item("a.py", "a1"), Item("a.py", "a2"),
            Item("b.py", "b1"), Item("b.py", "b2", fault=True),
            Item("c.py", "c1", fault=True), Item("c.py", "c2"), Item("c.py", "c3", fault=True),
            Item("d.py", "d1")]


def test_a_worker_takes_the_files_with_most_fault_tests_first_and_keeps_all_else_in_order() -> None:
    items = collection()
    pytest_collection_modifyitems(SimpleNamespace(workerinput={"workerid": "gw0"}), items)
    assert [i.name for i in items] == ["c1", "c2", "c3", "b1", "b2", "a1", "a2", "d1"]


def test_a_run_without_workers_keeps_pytests_order() -> None:
    items = collection()
    pytest_collection_modifyitems(SimpleNamespace(), items)
    assert [i.name for i in items] == [i.name for i in collection()]
