"""The fault suite's recorder: each fault test (marked ``@pytest.mark.fault(FAULT, holds=...)``)
records its outcome and measured recovery time as one JSON file, and
``scripts/gen_reliability_docs.py`` renders them into docs/reliability.md.

``FAULT`` is the row of issue 8 §2's table the test proves (its "fault" column, verbatim or
with a qualifier after a colon); ``holds`` is what the test checks, in the doc's words. The
fixture ``fault_record`` (tests/conftest.py) hands a :class:`FaultRecord` to the test; it is
written after the test ran, with outcome ``held`` when the test passed and ``failed`` otherwise
(a skipped test writes nothing). A fault known not to hold always is marked ``xfail`` with the
reason: its row says so (``does not always hold``), whether this run failed or not. Files go to the pytest cache
(``.pytest_cache/d/mlx-fleet-reliability/``, :data:`RESULTS_DIR`), one per test id, so a later
run of a subset refreshes only its rows.
"""

from __future__ import annotations

import json
import platform
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

#: The pytest cache directory (``config.cache.mkdir(RESULTS_DIR)``) holding the records.
RESULTS_DIR = "mlx-fleet-reliability"


@dataclass
class FaultRecord:
    """What one fault test measured. ``recovery_seconds``: from the end of the fault (etcd back,
    network healed, process killed) to the recovery the test awaited, on ``time.monotonic``;
    None when the row has no recovery to time. ``notes``: short facts ("0 of 212 requests
    failed during the outage"), shown in the doc's outcome column."""

    fault: str
    holds: str
    test: str
    notes: list[str] = field(default_factory=list)
    recovery_seconds: float | None = None
    _fault_ended: float | None = None

    def note(self, text: str) -> None:
        self.notes.append(text)

    def fault_ended(self) -> None:
        """Mark the moment the fault ends (the start of the recovery time)."""
        self._fault_ended = time.monotonic()

    def recovered(self) -> float:
        """Mark recovery now; returns and records the seconds since :meth:`fault_ended`.
        Raises ``RuntimeError`` if :meth:`fault_ended` was not called."""
        if self._fault_ended is None:
            raise RuntimeError("recovered() before fault_ended()")
        self.recovery_seconds = time.monotonic() - self._fault_ended
        return self.recovery_seconds

    def write(self, directory: Path, *, outcome: str, known_issue: str = "") -> Path:
        """Write ``{fault, holds, test, outcome, known_issue, recovery_seconds, notes, machine,
        measured_unix}`` as ``directory/<test id>.json``; returns the path. ``outcome``: the
        test's, ``passed`` / ``failed`` / ``xfailed`` / ``xpassed``; it is recorded as ``held``,
        ``failed`` or, for a test marked ``xfail`` (``known_issue``: its reason), ``flaky``:
        known not to hold always, whichever way this run went."""
        if outcome not in {"passed", "failed", "xfailed", "xpassed"}:
            raise ValueError(f"outcome {outcome!r}: passed, failed, xfailed or xpassed")
        path = directory / (re.sub(r"[^A-Za-z0-9_.-]+", "_", self.test) + ".json")
        path.write_text(json.dumps({
            "fault": self.fault, "holds": self.holds, "test": self.test,
            "outcome": ("flaky" if outcome.startswith("x") else
                        "held" if outcome == "passed" else "failed"),
            "known_issue": known_issue, "held_this_run": outcome in {"passed", "xpassed"},
            "recovery_seconds": self.recovery_seconds, "notes": self.notes,
            "machine": f"{platform.system()} {platform.machine()}, {_cpus()} CPUs",
            "measured_unix": time.time()}, indent=2) + "\n")
        return path


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0
