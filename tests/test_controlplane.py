"""The local control plane itself, and the CRD schema as enforced by a real kube-apiserver."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from mlx_fleet.devcluster.binaries import KUBERNETES_VERSION, Binaries
from mlx_fleet.devcluster.controlplane import ControlPlane, start_control_plane
from crd_cases import invalid_examples, valid_examples


def test_apiserver_reports_pinned_version(control_plane: ControlPlane) -> None:
    version = json.loads(control_plane.kubectl("get", "--raw", "/version").stdout)
    assert version["gitVersion"] == KUBERNETES_VERSION


def test_crd_is_established_with_printer_columns(control_plane: ControlPlane, namespace: str) -> None:
    crd = json.loads(control_plane.kubectl(
        "get", "crd", "modeldeployments.mlx-fleet.io", "-o", "json").stdout)
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions["Established"] == "True"
    assert "md" in crd["spec"]["names"]["shortNames"]
    # No operator watches this namespace: the object keeps the schema's defaults and no status.
    obj = valid_examples()[0]
    obj["metadata"]["namespace"] = namespace
    control_plane.kubectl("apply", "-f", "-", input=json.dumps(obj))
    # `kubectl get` (short name) renders the printer columns through the server-side Table API.
    header, row = control_plane.kubectl("get", "md", "-n", namespace).stdout.splitlines()[:2]
    assert header.split() == ["NAME", "MODEL", "REVISION", "READY", "DESIRED", "STATUS", "SERVED", "AGE"]
    assert row.split()[:3] == [obj["metadata"]["name"], obj["spec"]["model"]["source"],
                               obj["spec"]["model"]["revision"]]
    assert row.split()[3] == "1"  # DESIRED: spec.replicas defaulted by the schema; READY empty


@pytest.mark.parametrize("obj", valid_examples(), ids=lambda o: o["metadata"]["name"])
def test_valid_objects_accepted(control_plane: ControlPlane, obj: dict) -> None:
    out = control_plane.kubectl("apply", "--dry-run=server", "-o", "json", "-f", "-",
                                input=json.dumps(obj))
    applied = json.loads(out.stdout)
    assert applied["spec"]["replicas"] >= 0  # defaulted by the schema when absent


@pytest.mark.parametrize(("obj", "field"), invalid_examples(), ids=lambda v: v["metadata"]["name"]
                         if isinstance(v, dict) else v)
def test_invalid_objects_refused_naming_the_field(control_plane: ControlPlane, obj: dict, field: str) -> None:
    res = control_plane.kubectl("apply", "-f", "-", input=json.dumps(obj), check=False)
    assert res.returncode != 0, f"{obj['metadata']['name']} was accepted"
    assert "is invalid" in res.stderr
    assert field in res.stderr, res.stderr
    got = control_plane.kubectl("get", "md", obj["metadata"]["name"], check=False)
    assert got.returncode != 0  # nothing was stored


def test_example_manifest_is_valid(control_plane: ControlPlane) -> None:
    root = Path(__file__).resolve().parents[1]
    text = (root / "examples" / "modeldeployment.yaml").read_text().replace("${MODEL_DIR}", "/models/x")
    obj = yaml.safe_load(text)
    control_plane.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(obj))


def test_stop_leaves_no_process_or_directory(binaries: Binaries) -> None:
    cp = start_control_plane(binaries=binaries, install_crds=False)
    pids = [cp.etcd.process.pid, cp.kube_etcd.process.pid, cp.apiserver.pid]
    assert all(Path(f"/proc/{p}").exists() for p in pids)
    cp.stop()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not cp.workdir.exists()


def test_staging_replaces_are_read_from_kubernetes_gomod() -> None:
    from mlx_fleet.devcluster.binaries import _staging_modules

    gomod = """module k8s.io/kubernetes
replace (
\tk8s.io/api => ./staging/src/k8s.io/api
\tk8s.io/client-go => ./staging/src/k8s.io/client-go
\tgithub.com/example/x => github.com/example/x v1.2.3
)
replace k8s.io/kubectl => ./staging/src/k8s.io/kubectl
"""
    assert _staging_modules(gomod) == ["k8s.io/api", "k8s.io/client-go", "k8s.io/kubectl"]


def test_children_die_with_a_sigkilled_parent(tmp_path: Path) -> None:
    """A run that is SIGKILLed (no cleanup code runs) still leaves no process behind."""
    import select
    import subprocess
    import sys

    # The command tells a FIFO that it runs (after setpriv armed the death signal, which exec
    # keeps), then becomes `sleep`: the test kills the parent only then, on that event.
    fifo = tmp_path / "started"
    os.mkfifo(fifo)
    command = ["sh", "-c", 'echo started > "$0"; exec sleep 300', str(fifo)]
    code = (
        "import signal\n"
        "from pathlib import Path\n"
        "from mlx_fleet.devcluster.processes import ManagedProcess\n"
        f"p = ManagedProcess('sleeper', {command!r}, Path({str(tmp_path / 'log')!r}))\n"
        "print(p.pid, flush=True)\n"
        "signal.pause()\n"
    )
    started = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    pidfd = os.pidfd_open(child)  # readable once the process has exited
    try:
        assert select.select([started], [], [], 10)[0] == [started], "the command never ran"
        assert os.read(started, 64) == b"started\n"
        assert select.select([pidfd], [], [], 0)[0] == []  # running
        parent.kill()
        parent.wait()
        assert select.select([pidfd], [], [], 10)[0] == [pidfd], "child outlived its parent"
    finally:
        os.close(pidfd)
        os.close(started)
