"""Which test files need a real etcd: ``pytest -p etcd_usage [--collect-only] [--etcd-usage-json PATH] ...``.

A pytest plugin (not loaded by default; ``tests/`` must be on ``sys.path`` for ``-p`` to find it,
e.g. ``PYTHONPATH=tests``). At the end of the run it prints, per test file, how many of its
tests needed etcd, and the files that needed it at all; ``--etcd-usage-json PATH`` also writes
``{"mode": "run" | "collect", "files": {file: {"tests": n, "etcd": {test id: [reasons]}}},
"etcd_files": [file, ...]}``.

A test *needs etcd* when one of these holds:

- it has a session fixture that starts etcd, ``etcd_server`` or ``control_plane``
  (kube-apiserver runs on its own etcd, so ``namespace`` counts through it), in its fixture
  closure or requested at run time (``request.getfixturevalue``: the ``etcd`` parameter of
  ``any_store`` / ``memory_or_etcd_store``);
- it starts an etcd, a kube-apiserver or ``mlx-fleet dev up`` itself, in its body or one of its
  fixtures (``start_etcd``, ``start_control_plane`` or a CLI subprocess: every one of them goes
  through :class:`~mlx_fleet.devcluster.processes.ManagedProcess`).

Two modes, same rule:

- **run** (default): exact. ``ManagedProcess`` is wrapped to see what a test, or the setup of a
  fixture, launched; an autouse fixture reads the test's active fixture names after it ran
  (``request.fixturenames`` includes fixtures requested at run time), so a test served by a
  module- or session-scoped fixture that started etcd for an earlier test counts too. Works under pytest-xdist (the
  workers send their records to the controller).
- **collect** (``--collect-only``): runs nothing. The fixture closure of each collected test,
  with the ``any_store`` / ``memory_or_etcd_store`` parameter read from its id, plus a scan of
  the source of the test and of each fixture in its closure for a call that starts etcd
  (``start_etcd(``, ``start_control_plane(``, a ``"dev", "up"`` argv). It agrees with the run
  mode on this suite (checked file by file, issue 16's closing note); a helper outside
  ``tests/`` that starts etcd for a test would escape the scan, so trust the run mode where they
  differ.
"""

from __future__ import annotations

import inspect
import json
from collections import defaultdict
from pathlib import Path

import pytest

#: Session fixtures that start etcd (``control_plane``: etcd ×2 under kube-apiserver).
ETCD_FIXTURES = frozenset({"etcd_server", "control_plane"})
#: Fixtures that request ``etcd_store`` at run time when their parameter is ``"etcd"``.
STORE_CHOICE_FIXTURES = frozenset({"any_store", "memory_or_etcd_store"})
#: Source text of a call that starts etcd (collect mode's scan).
STARTS_ETCD = ("start_etcd(", "start_control_plane(", '"dev", "up"')
#: Executables launched through ManagedProcess that are, or start, an etcd (run mode).
ETCD_EXECUTABLES = frozenset({"etcd", "kube-apiserver"})

_USED = pytest.StashKey[set[str]]()
_RECORDER = pytest.StashKey["EtcdUsage"]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--etcd-usage-json", metavar="PATH", default=None,
                     help="etcd_usage: also write the per-file record as JSON to PATH")


def _launches_etcd(argv: list[str]) -> bool:
    """``argv`` (a ManagedProcess's) runs etcd or kube-apiserver, or ``mlx-fleet dev up``."""
    names = [Path(a).name for a in argv]
    if ETCD_EXECUTABLES.intersection(names):
        return True
    return any(a == "dev" and b == "up" for a, b in zip(argv, argv[1:]))


class EtcdUsage:
    """The per-test record: ``nodeid -> reasons`` (empty: the test ran without etcd)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.mode = "collect" if config.option.collectonly else "run"
        self.tests: dict[str, set[str]] = {}
        self.current: pytest.Item | None = None
        #: Fixtures being set up now, innermost last (run mode).
        self.setting_up: list[pytest.FixtureDef] = []
        #: (name, node id it is visible under) of each fixture whose setup launched an etcd (run mode): a module- or
        #: session-scoped one starts it for the first test only, and serves the later ones too.
        self.etcd_fixtures: set[tuple[str, str]] = set()
        self._unwrap = None

    # -- run mode ---------------------------------------------------------------------------

    def wrap_processes(self) -> None:
        """Wrap ``ManagedProcess.__init__`` (the class, so every import of it sees the wrapper)."""
        from mlx_fleet.devcluster.processes import ManagedProcess

        original = ManagedProcess.__init__
        usage = self

        def __init__(proc, name, argv, *args, **kwargs):  # noqa: N807 (a wrapped __init__)
            item = usage.current
            if _launches_etcd([str(a) for a in argv]):
                if usage.setting_up:  # the fixture whose own code launched it, not those that
                    d = usage.setting_up[-1]  # requested it (any_store[memory] does not need etcd)
                    usage.etcd_fixtures.add((d.argname, _visible_under(d)))
                if item is not None:
                    item.stash.setdefault(_USED, set()).add(f"launched {name}")
            original(proc, name, argv, *args, **kwargs)

        ManagedProcess.__init__ = __init__
        self._unwrap = lambda: setattr(ManagedProcess, "__init__", original)

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest):
        self.setting_up.append(fixturedef)
        try:
            return (yield)
        finally:
            self.setting_up.pop()

    def used_fixtures(self, item: pytest.Item, names: list[str]) -> set[str]:
        """Of the fixtures ``names`` a test had, those that start etcd: the session fixtures
        known to, and any fixture visible to the test whose setup launched one."""
        used = set(ETCD_FIXTURES.intersection(names))
        used.update(n for n, under in self.etcd_fixtures
                    if n in names and item.nodeid.startswith(under))
        return used

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        self.current = item
        try:
            return (yield)
        finally:
            self.current = None
            if self.mode == "run":
                self.tests[item.nodeid] = item.stash.get(_USED, set())

    # -- collect mode -----------------------------------------------------------------------

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if self.mode != "collect":
            return
        for item in session.items:
            self.tests[item.nodeid] = _static_reasons(item)

    # -- report -----------------------------------------------------------------------------

    def by_file(self) -> dict[str, dict[str, object]]:
        files: dict[str, dict[str, object]] = defaultdict(lambda: {"tests": 0, "etcd": {}})
        for nodeid, reasons in sorted(self.tests.items()):
            record = files[nodeid.split("::")[0]]
            record["tests"] += 1
            if reasons:
                record["etcd"][nodeid] = sorted(reasons)
        return dict(sorted(files.items()))

    def pytest_terminal_summary(self, terminalreporter) -> None:
        files = self.by_file()
        etcd_files = [f for f, r in files.items() if r["etcd"]]
        tr = terminalreporter
        tr.section(f"etcd usage ({self.mode} mode)")
        for f, r in files.items():
            tr.write_line(f"{len(r['etcd']):5d} of {r['tests']:4d} tests on etcd  {f}")
        tr.write_line(f"{len(etcd_files)} of {len(files)} test files need etcd")
        path = self.config.getoption("etcd_usage_json")
        if path:
            Path(path).write_text(json.dumps({"mode": self.mode, "files": files,
                                              "etcd_files": etcd_files}, indent=1) + "\n")

    # -- pytest-xdist: the workers' records go to the controller ----------------------------

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        workeroutput = getattr(self.config, "workeroutput", None)
        if workeroutput is not None:
            workeroutput["etcd_usage"] = {k: sorted(v) for k, v in self.tests.items()}

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:
        for nodeid, reasons in getattr(node, "workeroutput", {}).get("etcd_usage", {}).items():
            self.tests[nodeid] = set(reasons)


def _visible_under(fixturedef: pytest.FixtureDef) -> str:
    """The node id prefix of the tests that can see ``fixturedef`` ("" for a plugin's)."""
    node = getattr(fixturedef, "node", None)  # pytest >= 8.4; before, the node id as baseid
    return node.nodeid if node is not None else getattr(fixturedef, "baseid", "")


def _static_reasons(item: pytest.Item) -> set[str]:
    """Collect mode: why ``item`` would need etcd, from its closure, parameters and sources."""
    names = set(getattr(item, "fixturenames", ()))
    reasons = {f"fixture {n}" for n in names & ETCD_FIXTURES}
    params = getattr(getattr(item, "callspec", None), "params", {})
    for name in names & STORE_CHOICE_FIXTURES:
        if params.get(name, "memory") == "etcd":
            reasons.add(f"{name}[etcd]")
    info = getattr(item, "_fixtureinfo", None)  # pytest's own record of the closure's fixtures
    functions = [getattr(item, "obj", None)]
    if info is not None:
        for name in names - STORE_CHOICE_FIXTURES - ETCD_FIXTURES:
            functions += [d.func for d in info.name2fixturedefs.get(name, ())]
    for func in functions:
        try:
            source = inspect.getsource(func)
        except (OSError, TypeError):
            continue
        lines = source.splitlines()  # from the def on: a decorator's parameters start nothing
        first = next((i for i, line in enumerate(lines)
                      if line.lstrip().startswith(("def ", "async def "))), 0)
        source = "\n".join(lines[first:])
        for call in STARTS_ETCD:
            if call in source:
                reasons.add(f"{getattr(func, '__name__', func)} calls {call}")
    return reasons


@pytest.fixture(autouse=True)
def _etcd_usage_fixtures(request: pytest.FixtureRequest):
    """Run mode: after the test, the fixtures it had (also those requested at run time)."""
    yield
    used = request.config.stash[_RECORDER].used_fixtures(request.node, request.fixturenames)
    if used:
        request.node.stash.setdefault(_USED, set()).update(f"fixture {n}" for n in used)


def pytest_configure(config: pytest.Config) -> None:
    usage = EtcdUsage(config)
    if usage.mode == "run":
        usage.wrap_processes()
    config.pluginmanager.register(usage, "etcd_usage_recorder")
    config.stash[_RECORDER] = usage


def pytest_unconfigure(config: pytest.Config) -> None:
    usage = config.stash.get(_RECORDER, None)
    if usage is not None and usage._unwrap is not None:
        usage._unwrap()
