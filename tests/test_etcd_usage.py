"""tests/etcd_usage.py, the plugin that says which test files need a real etcd: its launch rule
(table), and both of its modes on a small suite run by pytester — fixtures by name, the store
parameter chosen per test, a process named etcd launched by a module fixture for its first test
only, and a test that launches one itself. No real etcd: the "etcd" launched runs ``sleep``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from etcd_usage import _launches_etcd

pytest_plugins = ["pytester"]


@pytest.mark.parametrize("argv, launches", [
    (["/cache/bin/etcd", "--name", "etcd-test"], True),
    (["/cache/bin/kube-apiserver", "--etcd-servers", "http://127.0.0.1:1"], True),
    (["python", "-m", "mlx_fleet.cli", "dev", "up", "--router"], True),
    (["python", "-m", "node_agent", "--etcd-endpoint", "http://127.0.0.1:2379"], False),
    (["python", "-m", "mlx_fleet_operator", "--etcd-prefix", "/dev/up"], False),
    (["/cache/bin/etcdctl", "get", "x"], False),
    (["python", "-m", "mlx_fleet.cli", "dev", "down"], False),
])
def test_launch_rule(argv: list[str], launches: bool) -> None:
    assert _launches_etcd(argv) is launches


CONFTEST = '''
import pytest

@pytest.fixture(scope="session")
def etcd_server():
    return "etcd"

@pytest.fixture
def etcd_store(etcd_server):
    return "etcd store"

@pytest.fixture
def memory_store():
    return "memory store"

@pytest.fixture
def memory_or_etcd_store(request):
    return request.getfixturevalue("etcd_store" if getattr(request, "param", "memory") == "etcd"
                                   else "memory_store")
'''

SUITE = '''
import pytest
from pathlib import Path
from mlx_fleet.devcluster.processes import ManagedProcess

ETCD = {etcd!r}  # an executable named etcd that sleeps

def start_etcd(log):
    return ManagedProcess("etcd", [ETCD, "30"], log)

@pytest.fixture(scope="module")
def own_etcd(tmp_path_factory):
    proc = start_etcd(tmp_path_factory.mktemp("etcd") / "etcd.log")
    yield proc
    proc.stop()

def test_plain():
    pass

def test_session_fixture(etcd_store):
    pass

@pytest.mark.parametrize("memory_or_etcd_store", ["etcd", "memory"], indirect=True)
def test_store_choice(memory_or_etcd_store):
    pass

@pytest.fixture(params=["etcd", "memory"])
def choose(request):  # like any_store, but collect mode does not know it
    return request.getfixturevalue("own_etcd") if request.param == "etcd" else None

def test_choose(choose):
    pass

def test_module_fixture_first(own_etcd):
    pass

def test_module_fixture_again(own_etcd):
    pass

def test_launches_itself(tmp_path):
    start_etcd(tmp_path / "etcd.log").stop()
'''


@pytest.fixture
def suite(pytester: pytest.Pytester, tmp_path_factory: pytest.TempPathFactory) -> pytest.Pytester:
    fake = tmp_path_factory.mktemp("bin") / "etcd"
    fake.write_text('#!/bin/sh\nexec sleep "$@"\n')
    fake.chmod(0o755)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_suite=SUITE.format(etcd=str(fake)),
                        test_other="def test_nothing():\n    pass\n")
    return pytester


def usage(pytester: pytest.Pytester, *args: str) -> dict:
    out = Path(pytester.path) / "usage.json"
    result = pytester.runpytest_subprocess("-p", "etcd_usage", "-p", "no:cacheprovider",
                                           "--etcd-usage-json", str(out), *args)
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(["*etcd usage*", "*1 of 2 test files need etcd*"])
    return json.loads(out.read_text())


WANT = {  # test -> why it needs etcd, in each mode (collect mode reads sources, not launches;
    # None: collect mode misses it, as its docstring says — it resolves the store parameter of
    # any_store / memory_or_etcd_store only, not of any fixture that requests one at run time)
    "test_session_fixture": ({"fixture etcd_server"}, {"fixture etcd_server"}),
    "test_store_choice[etcd]": ({"fixture etcd_server"}, {"memory_or_etcd_store[etcd]"}),
    # own_etcd starts here, for the [etcd] one only (not for `choose`, which only requested it)
    "test_choose[etcd]": ({"launched etcd", "fixture own_etcd"}, None),
    "test_module_fixture_first": ({"fixture own_etcd"}, {"own_etcd calls start_etcd("}),
    "test_module_fixture_again": ({"fixture own_etcd"}, {"own_etcd calls start_etcd("}),
    "test_launches_itself": ({"launched etcd"}, {"test_launches_itself calls start_etcd("}),
}


@pytest.mark.parametrize("mode", ["run", "collect"])
def test_both_modes_name_the_tests_that_need_etcd(suite: pytest.Pytester, mode: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), *paths]))
    got = usage(suite, *(["--collect-only"] if mode == "collect" else []))
    assert got["mode"] == mode and got["etcd_files"] == ["test_suite.py"]
    files = got["files"]
    assert files["test_other.py"] == {"tests": 1, "etcd": {}}
    assert files["test_suite.py"]["tests"] == 9
    etcd = {nodeid.split("::")[1]: set(reasons)
            for nodeid, reasons in files["test_suite.py"]["etcd"].items()}
    want = {test: reasons[0 if mode == "run" else 1] for test, reasons in WANT.items()}
    assert etcd == {test: r for test, r in want.items() if r is not None}
    # not there: test_plain, test_store_choice[memory], test_choose[memory]
