"""The Helm chart in charts/mlx-fleet sent to a real kube-apiserver (from tests/test_chart.py,
whose rendering helpers and ``helm`` fixture these use): a server-side dry run of the rendered
chart, ``helm install --dry-run=server`` with its notes, and a real ``helm install`` →
``upgrade`` → ``uninstall`` whose objects are read back from the API server.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from test_chart import CHART, DASHBOARDS, REPO, helm, helm_env, render, run_helm  # noqa: F401 (helm: a fixture)

pytestmark = pytest.mark.integration


# --- A real API server accepts the rendered chart ------------------------------------------------

def test_rendered_chart_passes_server_side_dry_run(helm: Path, control_plane: Any) -> None:
    # "default" exists in every cluster; a server-side dry run needs the namespace to exist.
    docs = render(helm, namespace="default")
    manifest = yaml.safe_dump_all(docs)
    proc = control_plane.kubectl("apply", "--dry-run=server", "-f", "-", input=manifest, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for doc in docs:
        assert f"{doc['kind'].lower()}/{doc['metadata']['name']}" in proc.stdout.lower().replace(
            ".rbac.authorization.k8s.io", "").replace(".apps", "").replace(".policy", "")


def test_helm_install_dry_run_against_a_real_api_server_renders_notes(helm: Path, control_plane: Any) -> None:
    proc = subprocess.run(
        [str(helm), "install", "mlx-fleet", str(CHART), "--namespace", "default", "--dry-run=server",
         "--kubeconfig", str(control_plane.kubeconfig)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env=helm_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert "etcd at:\n  https://etcd.mlx-fleet.svc:2379" in notes
    # the Secrets a closed install waits for
    assert "mlx-fleet-etcd-client: ca.crt, tls.crt, tls.key" in notes
    assert "mlx-fleet-router-api-keys: api-keys" in notes and "INSECURE" not in notes
    assert "kubectl get modeldeployments" in notes
    assert "http://mlx-fleet-router.default.svc/v1" in notes  # the fleet router's URL
    assert "peering" not in notes


# --- A real helm install / upgrade / uninstall ---------------------------------------------------

#: A stand-in for prometheus-operator's ServiceMonitor CRD (same group, version and kind; any
#: spec accepted): the real one is not vendored here, and only the object's creation is tested.
SERVICE_MONITOR_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
    "spec": {"group": "monitoring.coreos.com", "scope": "Namespaced",
             "names": {"kind": "ServiceMonitor", "plural": "servicemonitors",
                       "singular": "servicemonitor", "listKind": "ServiceMonitorList"},
             "versions": [{"name": "v1", "served": True, "storage": True, "schema": {
                 "openAPIV3Schema": {"type": "object",
                                     "x-kubernetes-preserve-unknown-fields": True}}}]}}


def test_helm_install_upgrade_uninstall_on_a_real_api_server(helm: Path, control_plane: Any) -> None:
    """The objects helm creates are read back from the API server. No kubelet (nor controller
    manager) runs here: the operator Pod is never created, let alone started; what is proven is
    that the API server accepts and stores every object as the chart means it."""
    import uuid

    ns, release = f"chart-{uuid.uuid4().hex[:6]}", f"mlx-fleet-{uuid.uuid4().hex[:6]}"
    kubectl = control_plane.kubectl
    kubectl("create", "namespace", ns)
    kubectl("apply", "-f", "-", input=json.dumps(SERVICE_MONITOR_CRD))
    kubectl("wait", "--for=condition=Established", "crd/servicemonitors.monitoring.coreos.com",
            "--timeout=30s")

    def helm_run(*args: str) -> str:
        proc = run_helm(helm, *args, "--namespace", ns, "--kubeconfig",
                        str(control_plane.kubeconfig))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    def get(kind: str, name: str = "", *flags: str) -> dict[str, Any]:
        return json.loads(kubectl("get", kind, *([name] if name else []), "-n", ns, *flags,
                                  "-o", "json").stdout)

    try:
        helm_run("install", release, str(CHART), "--set", "serviceMonitor.enabled=true")
        for crd in ("modeldeployments", "canaries", "macnodes"):
            assert get("crd", f"{crd}.mlx-fleet.io")["status"]["conditions"]
        deploy = get("deployment", release)
        [c] = deploy["spec"]["template"]["spec"]["containers"]
        assert deploy["spec"]["strategy"]["type"] == "Recreate"
        assert c["readinessProbe"]["httpGet"]["path"] == "/healthz"
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert get("service", f"{release}-metrics")["spec"]["ports"][0]["port"] == 8080
        assert get("serviceaccount", release)["metadata"]["name"] == release
        role = json.loads(kubectl("get", "clusterrole", release, "-o", "json").stdout)
        assert any("modeldeployments" in r.get("resources", []) for r in role["rules"])
        binding = json.loads(kubectl("get", "clusterrolebinding", release, "-o", "json").stdout)
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": release,
                                        "namespace": ns}]
        cms = get("configmaps", "", "-l", "grafana_dashboard=1")["items"]
        assert sorted(cm["metadata"]["name"] for cm in cms) == [
            f"{release}-dashboard-{d}" for d in DASHBOARDS]
        sm = get("servicemonitor", release)
        assert sm["spec"]["endpoints"][0]["port"] == "metrics"
        # The router: its Deployment, Service, PodDisruptionBudget and ServiceMonitor.
        router = get("deployment", f"{release}-router")
        assert router["spec"]["replicas"] == 2
        [rc_] = router["spec"]["template"]["spec"]["containers"]
        assert rc_["command"] == ["mlx-fleet-router"]
        assert rc_["readinessProbe"]["httpGet"]["path"] == "/health"
        assert get("service", f"{release}-router")["spec"]["ports"][0]["port"] == 80
        assert get("poddisruptionbudget", f"{release}-router")["spec"]["maxUnavailable"] == 1
        assert get("servicemonitor", f"{release}-router")["spec"]["endpoints"][0]["port"] == "http"
        assert f"--router-url=http://{release}-router.{ns}.svc" in c["args"]

        helm_run("upgrade", release, str(CHART), "--reuse-values", "--set", "metrics.port=9090")
        assert get("service", f"{release}-metrics")["spec"]["ports"][0]["port"] == 9090
        [c] = get("deployment", release)["spec"]["template"]["spec"]["containers"]
        assert "--metrics-port=9090" in c["args"]
        assert get("deployment", release)["metadata"]["generation"] == 2
        history = json.loads(helm_run("history", release, "-o", "json"))
        assert [h["revision"] for h in history] == [1, 2]

        # A bad value is refused by the schema, and the release stays at revision 2.
        bad = run_helm(helm, "upgrade", release, str(CHART), "--reuse-values", "--set",
                       "metrics.port=0", "--namespace", ns, "--kubeconfig",
                       str(control_plane.kubeconfig))
        assert bad.returncode != 0 and "at '/metrics/port'" in bad.stderr, bad.stderr
        assert len(json.loads(helm_run("history", release, "-o", "json"))) == 2

        helm_run("uninstall", release, "--wait", "--timeout", "60s")
        left = kubectl("get", "deployment,service,serviceaccount,configmap,servicemonitor,"
                       "poddisruptionbudget",
                       "-n", ns, "-l", f"app.kubernetes.io/instance={release}", "-o", "name").stdout
        assert left.strip() == ""
        assert kubectl("get", "clusterrole", release, check=False).returncode != 0
        # helm never deletes CRDs (they hold users' objects)
        assert get("crd", "modeldeployments.mlx-fleet.io")
    finally:
        run_helm(helm, "uninstall", release, "--namespace", ns, "--kubeconfig",
                 str(control_plane.kubeconfig))
        kubectl("delete", "namespace", ns, "--wait=false", check=False)
