#!/usr/bin/env python3
"""Generate docs/reliability.md from the fault suite: its rows from the tests, its outcomes and
recovery times from what the tests recorded.

Rows: every test function under ``tests/`` marked ``@pytest.mark.fault(FAULT, holds=...)``,
directly or on a ``pytest.param`` of its parametrisation, found by reading the source (``ast``;
nothing is imported or run). Measurements: the JSON files the ``fault_record`` fixture writes
(tests/fault_record.py) to the pytest cache, ``.pytest_cache/d/mlx-fleet-reliability/``. A row
with no new measurement keeps the one the page already shows, so running a subset of the suite
refreshes only its rows. The rows of issue 8 §2's table that no test covers are listed under
the table (:data:`ISSUE_ROWS`).

    python scripts/gen_reliability_docs.py            # rewrite docs/reliability.md
    python scripts/gen_reliability_docs.py --check    # exit 1 when rows differ from the tests
    python scripts/gen_reliability_docs.py --print    # the page on stdout

Run the suite first (``pytest tests/test_faults.py tests/test_e2e.py ...``, or the whole suite),
then this script. Standard library only.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import datetime
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "reliability.md"
TESTS = REPO / "tests"
RESULTS = REPO / ".pytest_cache" / "d" / "mlx-fleet-reliability"  # fault_record.RESULTS_DIR

#: Issue 8 §2's table, its "fault" column: a row is covered by a test whose fault is the same,
#: or the same followed by a colon and a qualifier ("slow or broken network to etcd: blackhole").
ISSUE_ROWS = (
    "agent SIGKILL mid-stream",
    "etcd stopped 30 s, then restarted from its data dir",
    "etcd frozen (SIGSTOP) 20 s",
    "etcd compaction while an agent's watch is down",
    "operator SIGKILL mid-reconcile, then restart",
    "two operator replicas",
    "slow or broken network to etcd",
    "client disconnects mid-stream",
    "slow-reading client",
    "a model that fails to load",  # the issue's "a model that fails to load / raises
    "a model that raises mid-generation",  # mid-generation", one row per half
    "a malformed record in etcd",
    "two `provision` runs at once",
)

HEADER = "| fault | must hold | outcome | recovery | measured | test |"
NOT_MEASURED = "not measured yet"
FLAKY = "**does not always hold**"

INTRO = """# Reliability: the fault suite

Issue 8 §2 lists the faults mlx-fleet must survive. Each row below is a test on real processes
(etcd, kube-apiserver, the operator and node agents as `mlx-fleet dev up` starts them, a
generated MLX model, all on loopback), bounded in time. **This page is generated**: the rows
come from the tests marked `@pytest.mark.fault` (a test that exists has a row, a row has a
test), the outcome and recovery time from what each test measured on its last run
(`tests/fault_record.py` writes them to the pytest cache). To refresh it, run the tests, then
`python scripts/gen_reliability_docs.py`; `tests/test_reliability_docs.py` checks that the rows
match the tests.

*Recovery* is the time from the end of the fault (etcd restarted or resumed, the network
healed, the broken deployment applied, the garbage written) to the recovery the test awaits:
for the etcd faults, every agent re-registered under a lease and `/health` ok again; for the
network faults, `/health` ok and the agent's report back in etcd. *—* means the row has no
recovery to time. Times come from a shared two-core machine and vary from run to run. A row
that says **does not always hold** is a known gap: its test is marked `xfail` (so the suite
stays green) with the reason the row quotes, and says whether it held on the run measured.

The etcd faults last as long as the issue says (30 s stopped, 20 s frozen) unless
`MLX_FLEET_FAULT_ETCD_DOWN_SECONDS` / `MLX_FLEET_FAULT_ETCD_FROZEN_SECONDS` shorten them; while
a fault lasts, clients keep sending requests to every agent and every one must succeed. An
agent that has lost etcd says `"status": "degraded"` on `/health` (still 200: its models keep
serving; see [node-agent.md](node-agent.md), "Health").
"""


@dataclasses.dataclass(frozen=True)
class Row:
    """One fault test: the issue's ``fault`` (optionally qualified after a colon), what it
    checks (``holds``) and its pytest node id (``test``)."""

    fault: str
    holds: str
    test: str


@dataclasses.dataclass(frozen=True)
class Measured:
    """A row's measurement as the page shows it."""

    outcome: str
    recovery: str
    measured: str


def _fault_marker(node: ast.AST) -> tuple[str, str] | None:
    """``(fault, holds)`` when ``node`` is ``pytest.mark.fault("...", holds="...")``."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "fault" and ast.unparse(node.func) == "pytest.mark.fault"):
        fault = ast.literal_eval(node.args[0])
        holds = next(ast.literal_eval(k.value) for k in node.keywords if k.arg == "holds")
        return fault, holds
    return None


def _param_id(param: ast.Call) -> str:
    for k in param.keywords:
        if k.arg == "id":
            return ast.literal_eval(k.value)
    first = ast.literal_eval(param.args[0])
    if not isinstance(first, str):
        raise ValueError(f"pytest.param at line {param.lineno}: give an id= for a fault row")
    return first


def scan(tests_dir: Path = TESTS) -> list[Row]:
    """Every fault row in ``tests_dir/test_*.py``, in file then source order. Raises
    ``ValueError`` for a marker whose arguments are not literals."""
    rows: list[Row] = []
    for path in sorted(tests_dir.glob("test_*.py")):
        rel = path.relative_to(tests_dir.parent).as_posix()
        for fn in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for deco in fn.decorator_list:
                if (m := _fault_marker(deco)) is not None:
                    rows.append(Row(m[0], m[1], f"{rel}::{fn.name}"))
                    continue
                for node in ast.walk(deco):
                    if (isinstance(node, ast.Call) and ast.unparse(node.func) == "pytest.param"):
                        for k in node.keywords:
                            if k.arg != "marks":
                                continue
                            marks = (k.value.elts if isinstance(k.value, (ast.List, ast.Tuple))
                                     else [k.value])
                            for m in filter(None, map(_fault_marker, marks)):
                                rows.append(Row(m[0], m[1], f"{rel}::{fn.name}[{_param_id(node)}]"))
    return sorted(rows, key=lambda r: _order(r.fault))


def _order(fault: str) -> int:
    return next((i for i, r in enumerate(ISSUE_ROWS) if _covers(r, fault)), len(ISSUE_ROWS))


def _covers(issue_row: str, fault: str) -> bool:
    return fault == issue_row or fault.startswith(issue_row + ":")


def load_results(results_dir: Path = RESULTS) -> dict[str, Measured]:
    """Measurements recorded by ``fault_record``, by test id."""
    out: dict[str, Measured] = {}
    for path in sorted(results_dir.glob("*.json")) if results_dir.is_dir() else []:
        r = json.loads(path.read_text())
        notes = "; ".join(r.get("notes") or [])
        if r["outcome"] == "flaky":
            ran = "held this run" if r["held_this_run"] else "failed this run"
            outcome = f"{FLAKY} ({ran}): {r['known_issue']}"
        else:
            outcome = ("held" if r["outcome"] == "held" else "**FAILED**") + (f": {notes}" if notes else "")
        rec = r.get("recovery_seconds")
        day = datetime.datetime.fromtimestamp(r["measured_unix"], datetime.timezone.utc).date()
        out[r["test"]] = Measured(outcome=outcome,
                                  recovery=_seconds(rec),
                                  measured=f"{day.isoformat()}, {r['machine']}")
    return out


def _seconds(value: float | None) -> str:
    """A recovery time as the page shows it: ``—`` for none, ms below a second."""
    if value is None:
        return "—"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.1f} s"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _uncell(text: str) -> str:
    return text.strip().replace("\\|", "|")


def parse_doc(text: str) -> list[tuple[Row, Measured]]:
    """The table's rows as the page shows them (the inverse of :func:`render`'s table)."""
    rows = []
    lines = text.splitlines()
    if HEADER not in lines:
        return []
    for line in lines[lines.index(HEADER) + 2:]:
        if not line.startswith("|"):
            break
        cells = [_uncell(c) for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        fault, holds, outcome, recovery, measured, test = cells
        rows.append((Row(fault, holds, test.strip("`")), Measured(outcome, recovery, measured)))
    return rows


def render(rows: list[Row], measured: dict[str, Measured]) -> str:
    """The page: intro, the table (one line per row; a row without a measurement says so), and
    the issue's rows no test covers."""
    lines = [INTRO, HEADER, "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        m = measured.get(r.test, Measured(NOT_MEASURED, "", ""))
        lines.append(f"| {_cell(r.fault)} | {_cell(r.holds)} | {_cell(m.outcome)} | "
                     f"{_cell(m.recovery)} | {_cell(m.measured)} | `{r.test}` |")
    missing = [i for i in ISSUE_ROWS if not any(_covers(i, r.fault) for r in rows)]
    lines += ["", "## Not covered by the suite yet", ""]
    lines += [f"- {i}" for i in missing] or ["Every row of issue 8 §2 has a test."]
    return "\n".join(lines) + "\n"


def generate(doc: Path = DOC, tests_dir: Path = TESTS, results_dir: Path = RESULTS) -> str:
    """The page with fresh measurements where there are any, the page's own elsewhere."""
    shown = {row.test: m for row, m in parse_doc(doc.read_text())} if doc.exists() else {}
    return render(scan(tests_dir), {**shown, **load_results(results_dir)})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--check", action="store_true",
                   help="exit 1 when the page's rows differ from the fault tests")
    g.add_argument("--print", action="store_true", help="print the page instead of writing it")
    ap.add_argument("--results", type=Path, default=RESULTS,
                    help=f"where fault_record wrote its JSON (default {RESULTS})")
    args = ap.parse_args(argv)
    if args.check:
        shown = [row for row, _ in parse_doc(DOC.read_text())]
        if shown != scan():
            print(f"{DOC} is out of date: run scripts/gen_reliability_docs.py", file=sys.stderr)
            return 1
        return 0
    text = generate(results_dir=args.results)
    if args.print:
        sys.stdout.write(text)
    else:
        DOC.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
