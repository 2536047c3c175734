"""Session fixtures: the real local control plane (etcd, kube-apiserver) from mlx_fleet.devcluster.

The binaries are built once and cached (``mlx-fleet provision``; the README's test command runs
it before pytest, with a progress bar). Every fixture tears its processes down, also on failure.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from fault_record import RESULTS_DIR, FaultRecord
from mlx_fleet.contract import Keys
from mlx_fleet.devcluster.binaries import Binaries, ensure_all
from mlx_fleet.devcluster.controlplane import ControlPlane, EtcdServer, start_control_plane, start_etcd
from mlx_fleet.memstore import MemoryStore
from mlx_fleet.store import EtcdStore

# Under pytest-xdist, the fault suite's files go to the workers first (tests/xdist_order.py).
pytest_plugins = ["xdist_order"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fault(fault, holds): a fault-suite test, one row of "
                                       "docs/reliability.md (tests/fault_record.py)")


_OUTCOME = pytest.StashKey[str]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    report = yield
    if report.when == "call":
        xfail = hasattr(report, "wasxfail")
        item.stash[_OUTCOME] = ("xpassed" if xfail and report.passed else "xfailed" if xfail
                                else "passed" if report.passed else "failed")
    return report


@pytest.fixture
def fault_record(request: pytest.FixtureRequest) -> Iterator[FaultRecord]:
    """The :class:`FaultRecord` of a test marked ``@pytest.mark.fault(FAULT, holds=...)``,
    written to the pytest cache after the test (outcome from its call phase; a known failure,
    ``xfail``, records its reason)."""
    marker = request.node.get_closest_marker("fault")
    if marker is None:
        raise pytest.UsageError(f"{request.node.nodeid} uses fault_record without a fault marker")
    record = FaultRecord(fault=marker.args[0], holds=marker.kwargs["holds"],
                         test=request.node.nodeid)
    yield record
    if _OUTCOME in request.node.stash:  # not when the setup failed or the test was skipped
        cache = getattr(request.config, "cache", None)
        xfail = request.node.get_closest_marker("xfail")
        if cache is not None:
            record.write(cache.mkdir(RESULTS_DIR), outcome=request.node.stash[_OUTCOME],
                         known_issue=xfail.kwargs.get("reason", "") if xfail else "")


@pytest.fixture(scope="session")
def binaries() -> Binaries:
    return ensure_all()


@pytest.fixture(scope="session")
def etcd_server(binaries: Binaries, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One real etcd for the session. Tests isolate themselves with a unique key root
    (see ``keys``), never by wiping the store."""
    server = start_etcd(tmp_path_factory.mktemp("etcd"), binaries, "etcd-test")
    yield server
    server.stop()


@pytest.fixture
def keys() -> Keys:
    """A contract key layout under a root unique to the test."""
    return Keys(f"/mlx-fleet-test/{uuid.uuid4().hex[:12]}")


@pytest.fixture
async def etcd_store(etcd_server: EtcdServer) -> AsyncIterator[EtcdStore]:
    """A client of the session's real etcd."""
    async with EtcdStore(etcd_server.client_url) as s:
        yield s


@pytest.fixture
def store(etcd_store: EtcdStore) -> EtcdStore:
    """The store a test runs on: the real etcd, unless its module overrides ``store`` (e.g. with
    ``memory_or_etcd_store``)."""
    return etcd_store


@pytest.fixture
async def memory_store() -> AsyncIterator[MemoryStore]:
    """A fresh :class:`~mlx_fleet.memstore.MemoryStore` (real-time lease expiry), for tests
    whose logic needs a store but not etcd itself."""
    async with MemoryStore() as s:
        yield s


@pytest.fixture(params=["etcd", "memory"])
def any_store(request: pytest.FixtureRequest) -> EtcdStore | MemoryStore:
    """The test runs twice: on the real etcd (``etcd_store``) and on ``memory_store`` — for the
    behaviour both must share (tests/test_store_contract.py)."""
    return request.getfixturevalue("etcd_store" if request.param == "etcd" else "memory_store")


@pytest.fixture
def memory_or_etcd_store(request: pytest.FixtureRequest) -> EtcdStore | MemoryStore:
    """``memory_store`` (logic that needs a store, not etcd), or the real etcd for a test marked
    :data:`stores.ON_ETCD` / :data:`stores.ON_BOTH`."""
    return request.getfixturevalue("etcd_store" if getattr(request, "param", "memory") == "etcd"
                                   else "memory_store")


@pytest.fixture(scope="session")
def control_plane(binaries: Binaries) -> Iterator[ControlPlane]:
    """etcd ×2 + kube-apiserver with the project's CRDs installed."""
    cp = start_control_plane(binaries=binaries)
    yield cp
    cp.stop()


@pytest.fixture(scope="module")
def namespace(control_plane: ControlPlane) -> Iterator[str]:
    """A Kubernetes namespace unique to the test module. Operators started by a module watch
    only its namespace (``--namespace``), so modules sharing the session's API server never see
    each other's objects. (There is no namespace controller here, so the namespace itself stays
    Terminating after deletion; that is harmless.)"""
    ns = f"t-{uuid.uuid4().hex[:8]}"
    control_plane.kubectl("create", "namespace", ns)
    yield ns
    control_plane.kubectl("delete", "namespace", ns, "--wait=false", check=False)


@pytest.fixture(scope="session")
def test_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small real MLX llama model (random weights, real BPE tokenizer) on disk."""
    from mlx_fleet.testmodel import make_test_model

    return make_test_model(tmp_path_factory.mktemp("models") / "tiny-llama")
