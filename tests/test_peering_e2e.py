"""Two real operator processes with kopf peering: only the active one (the higher priority)
exports the fleet metric families; when it stops, the other takes over and exports them.

kopf's peering CRD (kopfpeerings.kopf.dev, as kopf's own peering.yaml defines it) and the
KopfPeering object are created here: the operators run namespaced (``--namespace``), so kopf
uses the KopfPeering of that namespace. A stopping kopf marks its peer record dead at once, so
the takeover takes at most the operator's poll of the peering object (peering.POLL_SECONDS).
"""

from __future__ import annotations

import json
import urllib.request
import uuid
from pathlib import Path

import pytest

from fault_record import FaultRecord
from fleet_helpers import manifest

from mlx_fleet.devcluster.controlplane import ControlPlane
from mlx_fleet.devcluster.fleet import start_operator
from mlx_fleet.devcluster.processes import ManagedProcess, free_port

pytestmark = pytest.mark.integration

PEERING_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "kopfpeerings.kopf.dev"},
    "spec": {"scope": "Namespaced", "group": "kopf.dev",
             "names": {"kind": "KopfPeering", "plural": "kopfpeerings",
                       "singular": "kopfpeering"},
             "versions": [{"name": "v1", "served": True, "storage": True, "schema": {
                 "openAPIV3Schema": {"type": "object", "properties": {"status": {
                     "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}}}]}}


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def exporting(port: int) -> bool | None:
    """Whether the replica exports the fleet families: True/False, None while unknown."""
    text = scrape(port)
    has_fleet = 'mlxfleet_operator_nodes{health="Healthy"}' in text
    if "mlxfleet_operator_fleet_exporter 1.0" in text and has_fleet:
        return True
    if "mlxfleet_operator_fleet_exporter 0.0" in text and not has_fleet:
        return False
    return None


def log_of(op: ManagedProcess) -> str:
    return op.log_path.read_text(errors="replace")


@pytest.mark.fault("two operator replicas",
                   holds="never both reconcile: with kopf peering the lower-priority replica pauses, "
                         "runs no handler for a deployment the active one reconciles and is not the "
                         "fleet exporter; when the active one stops, the other takes over both "
                         "(recovery: from the stop to the takeover of the exporter role)")
def test_only_the_active_peer_exports_fleet_metrics(control_plane: ControlPlane,
                                                    namespace: str, fault_record: FaultRecord) -> None:
    control_plane.kubectl("apply", "-f", "-", input=json.dumps(PEERING_CRD))
    control_plane.kubectl("wait", "--for=condition=Established", "crd/kopfpeerings.kopf.dev",
                          "--timeout=30s")
    control_plane.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "kopf.dev/v1", "kind": "KopfPeering",
        "metadata": {"namespace": namespace, "name": "mlx-fleet"}}))
    root = f"/mlx-fleet-peering/{uuid.uuid4().hex[:8]}"
    ports = {"high": free_port(), "low": free_port()}
    ops: dict[str, ManagedProcess] = {}
    try:
        for name, priority in (("high", 20), ("low", 10)):
            ops[name] = start_operator(control_plane, etcd_prefix=root, metrics_port=ports[name],
                                       extra_args=("--namespace", namespace, "--peering",
                                                   "--peering-priority", str(priority)),
                                       log_name=f"operator-{name}")
        ops["high"].wait_until(lambda: exporting(ports["high"]) is True
                               and exporting(ports["low"]) is False,
                               timeout=30, what="the only fleet exporter")
        # A deployment (no Mac can serve it: its status says so): only the active one
        # reconciles it. kopf logs every object handler's run on the "kopf.objects" logger.
        control_plane.kubectl("apply", "-f", "-", input=manifest("peered", namespace,
                                                                 Path("/models/none")))
        control_plane.kubectl("wait", "--for=jsonpath={.status.observedGeneration}=1",
                              "modeldeployment/peered", "-n", namespace, "--timeout=60s",
                              timeout=70)
        tag = "kopf.objects"
        assert tag in log_of(ops["high"])
        assert tag not in log_of(ops["low"])
        ops["high"].stop()
        fault_record.fault_ended()
        ops["low"].wait_until(lambda: exporting(ports["low"]) is True, timeout=30,
                              what="the fleet exporter after the other replica stopped")
        fault_record.recovered()
        ops["low"].wait_until(lambda: tag in log_of(ops["low"]), timeout=30,
                              what="reconciling the deployment after the takeover")
        fault_record.note("the standby ran no handler while the active replica ran; it took over "
                          "the exporter role and the deployment's reconciles")
        control_plane.kubectl("delete", "modeldeployment", "peered", "-n", namespace,
                              "--timeout=60s", timeout=70)
    finally:
        for op in ops.values():
            op.stop()
