"""Under pytest-xdist (``./scripts/dev.sh test``), the workers get the fault suite's files first.

``--dist loadfile`` hands whole files to the workers as they free up, in collection order (the
script passes ``--no-loadscope-reorder`` so xdist keeps that order instead of sorting files by
their number of tests). The files holding fault tests (``@pytest.mark.fault``: etcd stopped 30 s
and frozen 20 s under load, the network faults, killed processes) are the longest by far —
tests/test_faults.py alone is about a quarter of the suite's time — so they start first, the file
with the most fault tests first, and never run alone at the end of a parallel run. Nothing else
moves: files keep pytest's order among themselves and tests their order within a file, and a run
without workers (``-n 0``, ``-p no:xdist``, a plain ``pytest``) keeps pytest's own order.
"""

from __future__ import annotations

from collections import Counter

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):  # only in an xdist worker (each collects the same)
        return
    faults = Counter(item.path for item in items if item.get_closest_marker("fault"))
    items.sort(key=lambda item: -faults[item.path])  # stable: all else keeps its order
