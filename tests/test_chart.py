"""The Helm chart in charts/mlx-fleet: ``helm lint``, ``helm template``, least-privilege RBAC, the
operator Deployment, optional pieces, values.schema.json, and its CRDs kept identical to crds/.

helm is built once from the Go module proxy and cached (mlx_fleet.devcluster.helm.ensure_helm);
these tests build it when it is missing rather than skip. The integration tests send the chart
to a real kube-apiserver: a server-side dry run, and a real ``helm install`` → ``upgrade`` →
``uninstall`` whose objects are read back from the API server.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from mlx_fleet.devcluster.helm import ensure_helm

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "mlx-fleet"
RELEASE, NAMESPACE = "mlx-fleet", "mlx-system"
FULLNAME = "mlx-fleet"  # the release name contains the chart name, so it is used as is
DASHBOARDS = ("canary", "fleet", "mac")  # charts/mlx-fleet/dashboards/*.json, sorted


@pytest.fixture(scope="module")
def helm() -> Path:
    return ensure_helm()


_HELM_HOME = Path(tempfile.gettempdir()) / "mlx-fleet-helm"


def helm_env() -> dict[str, str]:
    return {**os.environ, **{f"HELM_{k}_HOME": str(_HELM_HOME / k.lower()) for k in ("CACHE", "CONFIG", "DATA")}}


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run helm with its cache/config/data homes out of the user's and the repository's way."""
    return subprocess.run([str(helm), *args], cwd=REPO, capture_output=True, text=True, env=helm_env(),
                          timeout=120)


def render(helm: Path, *flags: str, namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    proc = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", namespace, *flags)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    [doc] = by_kind(docs, kind)
    return doc


@pytest.fixture(scope="module")
def default_docs(helm: Path) -> list[dict[str, Any]]:
    return render(helm)


# --- helm itself ---------------------------------------------------------------------------------

def test_helm_lint_strict(helm: Path) -> None:
    proc = run_helm(helm, "lint", "--strict", str(CHART))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout


def test_helm_lint_strict_with_every_option_on(helm: Path) -> None:
    proc = run_helm(helm, "lint", "--strict", str(CHART), "--set", "serviceMonitor.enabled=true",
                    "--set", "etcd.prefix=/fleet-a", "--set", "grafana.dashboards.enabled=true",
                    "--set", "operator.peering=true", "--set", "operator.verbose=true",
                    "--set", "operator.watchNamespaces={a,b}")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_default_render_holds_exactly_the_operator_objects(default_docs: list[dict[str, Any]]) -> None:
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in default_docs)
    assert kinds == [
        ("ClusterRole", FULLNAME), ("ClusterRoleBinding", FULLNAME),
        *[("ConfigMap", f"{FULLNAME}-dashboard-{d}") for d in DASHBOARDS],
        ("Deployment", FULLNAME), ("Service", f"{FULLNAME}-metrics"),
        ("ServiceAccount", FULLNAME),
    ]
    for doc in default_docs:
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/part-of"] == "mlx-fleet"
        assert labels["app.kubernetes.io/instance"] == RELEASE
        if doc["kind"] in {"ConfigMap", "Deployment", "Service", "ServiceAccount"}:
            assert doc["metadata"]["namespace"] == NAMESPACE


def test_include_crds_renders_the_crds_of_crds_dir(helm: Path) -> None:
    docs = render(helm, "--include-crds")
    rendered = sorted((d for d in docs if d.get("kind") == "CustomResourceDefinition"),
                      key=lambda d: d["metadata"]["name"])
    ours = [yaml.safe_load(p.read_text()) for p in sorted((REPO / "crds").glob("*.yaml"))]
    assert rendered == sorted(ours, key=lambda d: d["metadata"]["name"])
    assert {d["spec"]["names"]["kind"] for d in rendered} == {"ModelDeployment", "Canary", "MacNode"}


# --- CRDs ----------------------------------------------------------------------------------------

def test_chart_crds_are_byte_identical_to_crds_dir() -> None:
    ours = {p.name: p.read_bytes() for p in sorted((REPO / "crds").glob("*.yaml"))}
    chart = {p.name: p.read_bytes() for p in sorted((CHART / "crds").glob("*.yaml"))}
    assert ours, "crds/ holds the CRD manifests"
    assert chart.keys() == ours.keys(), "copy crds/*.yaml to charts/mlx-fleet/crds/"
    stale = [name for name in ours if chart[name] != ours[name]]
    assert stale == [], (f"charts/mlx-fleet/crds/ is out of date for {stale}: run python -m "
                         f"mlx_fleet_operator.crd (it writes both copies of the ModelDeployment and "
                         f"Canary CRDs); cp crds/mlx-fleet.io_macnodes.yaml charts/mlx-fleet/crds/")


# --- RBAC ----------------------------------------------------------------------------------------

def test_rbac_has_no_wildcards(default_docs: list[dict[str, Any]]) -> None:
    rules = one(default_docs, "ClusterRole")["rules"]
    assert rules
    for rule in rules:
        for key in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule.get(key, []), rule
            assert not any("*" in v for v in rule.get(key, [])), rule
        assert "nonResourceURLs" not in rule and "resourceNames" not in rule


def test_rbac_is_exactly_what_a_kopf_operator_needs(default_docs: list[dict[str, Any]]) -> None:
    grants = {(g, r): set(rule["verbs"])
              for rule in one(default_docs, "ClusterRole")["rules"]
              for g in rule["apiGroups"] for r in rule["resources"]}
    assert grants == {
        ("mlx-fleet.io", "modeldeployments"): {"get", "list", "watch", "patch", "update"},
        ("mlx-fleet.io", "modeldeployments/status"): {"get", "patch", "update"},
        ("mlx-fleet.io", "modeldeployments/finalizers"): {"get", "patch", "update"},
        ("mlx-fleet.io", "canaries"): {"get", "list", "watch", "patch", "update"},
        ("mlx-fleet.io", "canaries/status"): {"get", "patch", "update"},
        ("mlx-fleet.io", "macnodes"): {"get", "list", "watch", "create", "patch", "update"},
        ("mlx-fleet.io", "macnodes/status"): {"get", "patch", "update"},
        ("", "events"): {"create", "patch"},
        ("events.k8s.io", "events"): {"create", "patch"},
        ("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"},
        ("", "namespaces"): {"list", "watch"},
    }
    # Nothing that reads secrets or deletes what users own.
    all_verbs = set().union(*grants.values())
    assert "delete" not in all_verbs and "deletecollection" not in all_verbs
    assert not any(r == "secrets" for _, r in grants)


def test_peering_adds_exactly_the_kopf_peering_rbac(helm: Path, default_docs: list[dict[str, Any]]) -> None:
    def grants(docs: list[dict[str, Any]]) -> dict[tuple[str, str], set[str]]:
        return {(g, r): set(rule["verbs"]) for rule in one(docs, "ClusterRole")["rules"]
                for g in rule["apiGroups"] for r in rule["resources"]}

    standalone, peering = grants(default_docs), grants(render(helm, "--set", "operator.peering=true"))
    assert {k: v for k, v in peering.items() if k not in standalone} == {
        ("kopf.dev", "clusterkopfpeerings"): {"get", "list", "watch", "patch"},
        ("kopf.dev", "kopfpeerings"): {"get", "list", "watch", "patch"},
    }
    assert standalone.items() <= peering.items()


def test_binding_ties_the_role_to_the_operator_service_account(default_docs: list[dict[str, Any]]) -> None:
    binding = one(default_docs, "ClusterRoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": one(default_docs, "ClusterRole")["metadata"]["name"]}
    sa = one(default_docs, "ServiceAccount")["metadata"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["name"], "namespace": NAMESPACE}]
    pod = one(default_docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa["name"]


def test_rbac_create_false_renders_no_rbac(helm: Path) -> None:
    docs = render(helm, "--set", "rbac.create=false")
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")


# --- Deployment, Service, options ---------------------------------------------------------------

def _container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    [container] = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def test_operator_deployment(default_docs: list[dict[str, Any]]) -> None:
    deploy = one(default_docs, "Deployment")
    assert deploy["spec"]["replicas"] == 1
    assert deploy["spec"]["strategy"] == {"type": "Recreate"}
    pod = deploy["spec"]["template"]
    assert deploy["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    c = _container(default_docs)
    assert c["image"] == "ghcr.io/mlx-fleet/mlx-fleet-operator:0.1.0"
    assert c["command"] == ["mlx-fleet-operator"]
    assert c["args"] == ["--etcd-endpoint=http://etcd.mlx-fleet.svc:2379", "--metrics-port=8080",
                         "--liveness-port=8081", "--standalone"]
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"metrics": 8080, "health": 8081}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]


@pytest.mark.parametrize("flags", [(), ("--set", "etcd.prefix=/fleet-a", "--set", "operator.peering=true",
                                       "--set", "operator.verbose=true", "--set", "operator.watchNamespaces={a,b-*}")],
                         ids=["defaults", "every-option"])
def test_rendered_args_parse_with_the_operators_own_cli(helm: Path, flags: tuple[str, ...]) -> None:
    from mlx_fleet_operator.main import build_parser

    c = _container(render(helm, *flags))
    assert c["command"] == ["mlx-fleet-operator"]
    args = build_parser().parse_args(c["args"])  # exits (SystemExit) on an unknown flag
    assert args.etcd_endpoint == "http://etcd.mlx-fleet.svc:2379"
    assert (args.metrics_port, args.liveness_port) == (8080, 8081)
    if flags:
        assert (args.etcd_prefix, args.standalone, args.verbose, args.namespace) == ("/fleet-a", False, True, ["a", "b-*"])
        assert args.peering_name == "mlx-fleet"
    else:
        assert (args.standalone, args.namespace) == (True, [])


def test_operator_runs_non_root_with_a_read_only_root_fs(default_docs: list[dict[str, Any]]) -> None:
    pod = one(default_docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    sc = _container(default_docs)["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    # The only writable place is an emptyDir at /tmp (HOME points there).
    assert {m["mountPath"] for m in _container(default_docs)["volumeMounts"]} == {"/tmp"}
    assert {"name": "HOME", "value": "/tmp"} in _container(default_docs)["env"]


def test_metrics_service_selects_the_operator(default_docs: list[dict[str, Any]]) -> None:
    svc = one(default_docs, "Service")
    pod_labels = one(default_docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert svc["spec"]["ports"] == [{"name": "metrics", "port": 8080, "targetPort": "metrics", "protocol": "TCP"}]


def test_etcd_endpoint_and_prefix(helm: Path) -> None:
    args = _container(render(helm, "--set", "etcd.endpoints={http://etcd-0:2379}", "--set", "etcd.prefix=/fleet-a"))["args"]
    assert args[:2] == ["--etcd-endpoint=http://etcd-0:2379", "--etcd-prefix=/fleet-a"]


@pytest.mark.parametrize(("flags", "message"), [
    (("--set", "etcd.endpoints=null"), "etcd.endpoints must list one etcd client URL"),
    (("--set", "etcd.endpoints={http://a:2379,http://b:2379}"),
     "etcd.endpoints: the operator accepts exactly one etcd endpoint for now"),
    (("--set", "etcd.tls.secretName=etcd-client-tls"),
     "etcd.tls.secretName needs an https:// etcd endpoint"),
    (("--set", "etcd.auth.username=mlx-fleet-operator"),
     "etcd.auth.username needs etcd.auth.passwordSecret.name"),
], ids=["no-endpoint", "two-endpoints", "tls-over-http", "user-without-password"])
def test_unsupported_etcd_values_fail_with_a_message(helm: Path, flags: tuple[str, ...], message: str) -> None:
    proc = run_helm(helm, "template", RELEASE, str(CHART), *flags)
    assert proc.returncode != 0
    assert message in proc.stderr


def test_etcd_tls_and_password_auth_mount_secrets_as_files(helm: Path) -> None:
    """Client certificates and the password come from Secrets mounted read-only; the operator
    gets file paths (its own flags parse them), never the secret material itself."""
    from mlx_fleet_operator.main import build_parser

    docs = render(helm, "--set", "etcd.endpoints={https://etcd.mlx-fleet.svc:2379}",
                  "--set", "etcd.tls.secretName=etcd-client-tls",
                  "--set", "etcd.auth.username=mlx-fleet-operator",
                  "--set", "etcd.auth.passwordSecret.name=etcd-operator-password")
    c = _container(docs)
    args = build_parser().parse_args(c["args"])
    assert (args.etcd_ca_file, args.etcd_cert_file, args.etcd_key_file) == (
        "/etc/mlx-fleet/etcd-tls/ca.crt", "/etc/mlx-fleet/etcd-tls/tls.crt",
        "/etc/mlx-fleet/etcd-tls/tls.key")
    assert (args.etcd_username, args.etcd_password_file) == (
        "mlx-fleet-operator", "/etc/mlx-fleet/etcd-auth/password")
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["etcd-tls"]["readOnly"] and mounts["etcd-auth"]["readOnly"]
    volumes = {v["name"]: v for v in one(docs, "Deployment")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["etcd-tls"]["secret"]["secretName"] == "etcd-client-tls"
    assert volumes["etcd-auth"]["secret"] == {"secretName": "etcd-operator-password",
                                              "defaultMode": 0o400,
                                              "items": [{"key": "password", "path": "password"}]}
    assert not any("password" in e.get("name", "").lower() for e in c["env"])


def test_watch_namespaces_and_peering(helm: Path) -> None:
    docs = render(helm, "--set", "operator.watchNamespaces={team-a,team-*}", "--set", "operator.peering=true",
                  "--set", "operator.verbose=true", "--set", "operator.extraArgs={--foo=bar}")
    assert _container(docs)["args"][-7:] == [
        "--liveness-port=8081", "--namespace=team-a", "--namespace=team-*", "--peering",
        "--peering-name=mlx-fleet", "--verbose", "--foo=bar"]


def test_peering_renders_the_peering_objects_kopf_needs(helm: Path, default_docs: list[dict[str, Any]]) -> None:
    """kopf's mandatory peering needs an object named --peering-name: cluster-wide one
    ClusterKopfPeering, namespaced a KopfPeering per (non-glob) watched namespace."""
    assert not by_kind(default_docs, "ClusterKopfPeering") and not by_kind(default_docs, "KopfPeering")
    cluster = render(helm, "--set", "operator.peering=true", "--set", "operator.peeringName=fleet-a")
    peering = one(cluster, "ClusterKopfPeering")
    assert (peering["apiVersion"], peering["metadata"]["name"]) == ("kopf.dev/v1", "fleet-a")
    assert "--peering-name=fleet-a" in _container(cluster)["args"]
    assert not by_kind(cluster, "KopfPeering")
    namespaced = render(helm, "--set", "operator.peering=true", "--set", "operator.watchNamespaces={team-a,team-*,b}")
    assert not by_kind(namespaced, "ClusterKopfPeering")
    assert sorted((d["metadata"]["namespace"], d["metadata"]["name"]) for d in by_kind(namespaced, "KopfPeering")) == [
        ("b", "mlx-fleet"), ("team-a", "mlx-fleet")]
    values = (CHART / "values.yaml").read_text()
    assert "clusterkopfpeerings.kopf.dev" in values and "kopfpeerings.kopf.dev" in values


def test_service_monitor_is_opt_in(helm: Path, default_docs: list[dict[str, Any]]) -> None:
    assert not by_kind(default_docs, "ServiceMonitor")
    docs = render(helm, "--set", "serviceMonitor.enabled=true", "--set", "serviceMonitor.labels.release=prom")
    sm = one(docs, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["selector"]["matchLabels"].items() <= one(docs, "Service")["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}


def test_dashboards_are_configmaps_for_the_grafana_sidecar(helm: Path,
                                                          default_docs: list[dict[str, Any]]) -> None:
    cms = sorted(by_kind(default_docs, "ConfigMap"), key=lambda d: d["metadata"]["name"])
    assert [cm["metadata"]["labels"]["grafana_dashboard"] for cm in cms] == ["1"] * len(DASHBOARDS)
    for cm, name in zip(cms, DASHBOARDS):
        [(key, text)] = cm["data"].items()
        assert key == f"{name}.json"
        assert text.strip() == (CHART / "dashboards" / key).read_text().strip()
        assert json.loads(text)["uid"] == f"mlx-fleet-{name}"
    assert not by_kind(render(helm, "--set", "grafana.dashboards.enabled=false"), "ConfigMap")
    relabelled = render(helm, "--set", "grafana.dashboards.label=dash", "--set",
                        "grafana.dashboards.labelValue=yes")
    assert {cm["metadata"]["labels"]["dash"] for cm in by_kind(relabelled, "ConfigMap")} == {"yes"}


@pytest.mark.parametrize("flags, message", [
    (("--set", "replicaCount=-1"), "at '/replicaCount': minimum: got -1, want 0"),
    (("--set", "metrics.port=http"), "at '/metrics/port': got string, want integer"),
    (("--set", "image.pullPolicy=Sometimes"), "at '/image/pullPolicy'"),
    (("--set", "etcd.endpoints={etcd:2379}"), "at '/etcd/endpoints/0'"),
    (("--set", "serviceMonitor.interval=30"), "at '/serviceMonitor/interval'"),
    (("--set", "operatr.verbose=true"), "additional properties 'operatr' not allowed"),
    (("--set", "dnsPolicy=Cluster"), "at '/dnsPolicy'"),
    (("--set", "hostNetwork=yes"), "at '/hostNetwork': got string, want boolean"),
    (("--set", "kubernetesAPI.host=https://x"), "at '/kubernetesAPI/host'"),
    (("--set", "probes.startup.periodSeconds=0"), "at '/probes/startup/periodSeconds'"),
    (("--set", "probes.startup.httpGet=x"), "additional properties 'httpGet' not allowed"),
], ids=["negative-replicas", "port-not-int", "pull-policy", "endpoint-scheme", "interval-unit",
        "typo", "dns-policy", "host-network-bool", "api-host-not-url", "probe-period",
        "probe-handler-fixed"])
def test_values_schema_rejects_bad_values_with_a_message(helm: Path, flags: tuple[str, ...],
                                                         message: str) -> None:
    proc = run_helm(helm, "template", RELEASE, str(CHART), *flags)
    assert proc.returncode != 0
    assert "values don't meet the specifications of the schema" in proc.stderr, proc.stderr
    assert message in proc.stderr, proc.stderr


def test_host_network_and_dns_policy(helm: Path, default_docs: list[dict[str, Any]]) -> None:
    pod = one(default_docs, "Deployment")["spec"]["template"]["spec"]
    assert "hostNetwork" not in pod and "dnsPolicy" not in pod  # the cluster's defaults
    pod = one(render(helm, "--set", "hostNetwork=true"), "Deployment")["spec"]["template"]["spec"]
    assert (pod["hostNetwork"], pod["dnsPolicy"]) == (True, "ClusterFirstWithHostNet")
    pod = one(render(helm, "--set", "hostNetwork=true", "--set", "dnsPolicy=Default"),
              "Deployment")["spec"]["template"]["spec"]
    assert (pod["hostNetwork"], pod["dnsPolicy"]) == (True, "Default")


def test_kubernetes_api_override_is_opt_in(helm: Path, default_docs: list[dict[str, Any]]) -> None:
    assert not [e for e in _container(default_docs)["env"] if e["name"].startswith("KUBERNETES_")]
    env = _container(render(helm, "--set", "kubernetesAPI.host=127.0.0.1",
                            "--set", "kubernetesAPI.port=6443"))["env"]
    assert {"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"} in env
    assert {"name": "KUBERNETES_SERVICE_PORT", "value": "6443"} in env
    proc = run_helm(helm, "template", RELEASE, str(CHART), "--set", "kubernetesAPI.port=6443")
    assert proc.returncode != 0 and "kubernetesAPI.port needs kubernetesAPI.host" in proc.stderr


def test_probes_all_use_healthz_with_the_values_timings(helm: Path,
                                                        default_docs: list[dict[str, Any]]) -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())["probes"]
    c = _container(default_docs)
    for kind in ("startup", "liveness", "readiness"):
        probe = c[f"{kind}Probe"]
        assert probe.pop("httpGet") == {"path": "/healthz", "port": "health"}
        assert probe == values[kind]
    c = _container(render(helm, "--set", "probes.readiness.periodSeconds=3"))
    assert c["readinessProbe"]["periodSeconds"] == 3


def test_values_defaults() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["replicaCount"] == 1
    assert values["metrics"]["port"] == 8080
    assert values["serviceMonitor"]["enabled"] is False
    assert values["grafana"]["dashboards"]["enabled"] is True
    assert values["etcd"]["tls"]["secretName"] == "" and values["etcd"]["auth"]["username"] == ""
    assert values["operator"]["peering"] is False
    assert set(values["image"]) == {"repository", "tag", "pullPolicy"}


# --- A real API server accepts the rendered chart ------------------------------------------------

@pytest.mark.integration
def test_rendered_chart_passes_server_side_dry_run(helm: Path, control_plane: Any) -> None:
    # "default" exists in every cluster; a server-side dry run needs the namespace to exist.
    docs = render(helm, namespace="default")
    manifest = yaml.safe_dump_all(docs)
    proc = control_plane.kubectl("apply", "--dry-run=server", "-f", "-", input=manifest, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for doc in docs:
        assert f"{doc['kind'].lower()}/{doc['metadata']['name']}" in proc.stdout.lower().replace(
            ".rbac.authorization.k8s.io", "").replace(".apps", "")


@pytest.mark.integration
def test_helm_install_dry_run_against_a_real_api_server_renders_notes(helm: Path, control_plane: Any) -> None:
    proc = subprocess.run(
        [str(helm), "install", "mlx-fleet", str(CHART), "--namespace", "default", "--dry-run=server",
         "--kubeconfig", str(control_plane.kubeconfig)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env=helm_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert "etcd at:\n  http://etcd.mlx-fleet.svc:2379" in notes
    assert "kubectl get modeldeployments" in notes
    assert "peering" not in notes


def test_notes_say_kopf_peering_crds_must_be_installed() -> None:
    # Rendered only with operator.peering=true; a server dry run of that release fails without
    # kopf's CRDs (the point of the note), so the template text is checked here.
    notes = (CHART / "templates" / "NOTES.txt").read_text()
    assert "{{- if .Values.operator.peering }}" in notes
    assert "CRDs (clusterkopfpeerings.kopf.dev, kopfpeerings.kopf.dev) must be installed" in notes.replace("\n", " ")


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


@pytest.mark.integration
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
        left = kubectl("get", "deployment,service,serviceaccount,configmap,servicemonitor",
                       "-n", ns, "-l", f"app.kubernetes.io/instance={release}", "-o", "name").stdout
        assert left.strip() == ""
        assert kubectl("get", "clusterrole", release, check=False).returncode != 0
        # helm never deletes CRDs (they hold users' objects)
        assert get("crd", "modeldeployments.mlx-fleet.io")
    finally:
        run_helm(helm, "uninstall", release, "--namespace", ns, "--kubeconfig",
                 str(control_plane.kubeconfig))
        kubectl("delete", "namespace", ns, "--wait=false", check=False)
