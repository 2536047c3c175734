"""docs/reliability.md is generated (scripts/gen_reliability_docs.py): its rows are the fault
tests that exist, in the page's structure; the renderer and the recorder agree. Pure: no
cluster, nothing run but the script's functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from fault_record import FaultRecord

REPO = Path(__file__).resolve().parents[1]
GENERATOR = REPO / "scripts" / "gen_reliability_docs.py"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_reliability_docs", GENERATOR)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


gen = _generator()


def test_the_page_has_a_row_for_every_fault_test_and_no_other() -> None:
    shown = [row for row, _ in gen.parse_doc(gen.DOC.read_text())]
    assert shown == gen.scan(), "run scripts/gen_reliability_docs.py after the fault tests"
    assert gen.main(["--check"]) == 0


def test_the_page_is_what_the_script_renders_from_its_own_measurements() -> None:
    text = gen.DOC.read_text()
    measured = {row.test: m for row, m in gen.parse_doc(text)}
    assert gen.render(gen.scan(), measured) == text


def test_no_row_of_the_page_shows_a_failed_fault() -> None:
    failed = [row.test for row, m in gen.parse_doc(gen.DOC.read_text())
              if not m.outcome.startswith(("held", gen.NOT_MEASURED, gen.FLAKY))]
    assert not failed, f"the page shows fault rows that did not hold: {failed}"


SAMPLE = '''
import pytest

@pytest.mark.fault("etcd frozen (SIGSTOP) 20 s", holds="kept")
async def test_direct():
    pass

@pytest.mark.parametrize("mode", [
    pytest.param("latency", marks=pytest.mark.fault("slow or broken network to etcd: latency",
                                                   holds="ok")),
    pytest.param(3, id="three", marks=pytest.mark.fault("a malformed record in etcd", holds="x|y")),
    pytest.param("plain"),
    pytest.param("listed", marks=[pytest.mark.xfail(reason="a race"),
                                  pytest.mark.fault("etcd frozen (SIGSTOP) 20 s", holds="both")]),
])
def test_params(mode):
    pass

def test_unmarked():
    pass
'''


def test_scan_finds_direct_and_parametrised_markers_in_the_issue_order(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_sample.py").write_text(SAMPLE)
    assert gen.scan(tmp_path / "tests") == [
        gen.Row("etcd frozen (SIGSTOP) 20 s", "kept", "tests/test_sample.py::test_direct"),
        gen.Row("etcd frozen (SIGSTOP) 20 s", "both", "tests/test_sample.py::test_params[listed]"),
        gen.Row("slow or broken network to etcd: latency", "ok",
                "tests/test_sample.py::test_params[latency]"),
        gen.Row("a malformed record in etcd", "x|y", "tests/test_sample.py::test_params[three]"),
    ]


@pytest.mark.parametrize(("ran", "recovery", "notes", "outcome", "shown_recovery"), [
    ("passed", 2.345, ["0 of 10 requests failed"], "held: 0 of 10 requests failed", "2.3 s"),
    ("passed", None, [], "held", "—"),
    ("passed", 0.0412, [], "held", "41 ms"),
    ("failed", 1.0, ["late"], "**FAILED**: late", "1.0 s"),
    ("xfailed", 1.0, ["late"], "**does not always hold** (failed this run): a race", "1.0 s"),
    ("xpassed", None, [], "**does not always hold** (held this run): a race", "—"),
])
def test_recorded_results_render_and_parse_back(tmp_path: Path, ran: str, recovery: float | None,
                                                notes: list[str], outcome: str,
                                                shown_recovery: str) -> None:
    rec = FaultRecord(fault="a malformed record in etcd", holds="logged | skipped",
                      test="tests/test_x.py::test_y", notes=notes)
    if recovery is not None:
        rec.recovery_seconds = recovery
    rec.write(tmp_path, outcome=ran, known_issue="a race" if ran.startswith("x") else "")
    results = gen.load_results(tmp_path)
    m = results["tests/test_x.py::test_y"]
    assert (m.outcome, m.recovery) == (outcome, shown_recovery)
    row = gen.Row(rec.fault, rec.holds, rec.test)
    text = gen.render([row], results)
    assert gen.parse_doc(text) == [(row, m)]  # a "|" in a cell survives the round trip
    assert "- two `provision` runs at once" in text  # issue rows without a test are listed


def test_a_row_without_a_measurement_says_so() -> None:
    row = gen.Row("two `provision` runs at once", "one builds", "tests/test_p.py::test_p")
    ((_, m),) = gen.parse_doc(gen.render([row], {}))
    assert m.outcome == gen.NOT_MEASURED


def test_recovered_needs_the_end_of_the_fault() -> None:
    rec = FaultRecord(fault="f", holds="h", test="t")
    with pytest.raises(RuntimeError, match="fault_ended"):
        rec.recovered()
    rec.fault_ended()
    assert rec.recovered() >= 0 and rec.recovery_seconds is not None
