"""Layering rules, checked by import-linter against the real import graph (contracts live in
pyproject.toml): pure decision modules import no I/O library; operator and agent stay apart."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    res = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 broken" in res.stdout


def test_no_package_shadows_stdlib_operator() -> None:
    assert not (ROOT / "operator" / "__init__.py").exists()
    import operator

    assert hasattr(operator, "itemgetter")  # still the standard library's module
