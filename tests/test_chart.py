"""The Helm chart in charts/mlx-fleet: ``helm lint``, ``helm template``, least-privilege RBAC, the
operator Deployment, optional pieces, values.schema.json, and its CRDs kept identical to crds/.

helm is built once from the Go module proxy and cached (mlx_fleet.devcluster.helm.ensure_helm);
these tests build it when it is missing rather than skip. The chart sent to a real
kube-apiserver (a server-side dry run, a real ``helm install`` → ``upgrade`` → ``uninstall``) is
in tests/test_integration_chart.py.
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


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    """The one object of ``kind`` (named ``name`` when given)."""
    [doc] = [d for d in by_kind(docs, kind) if name is None or d["metadata"]["name"] == name]
    return doc


ROUTER = f"{FULLNAME}-router"  # the router's Deployment, Service, PDB and ServiceMonitor


def operator_deployment(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(docs, "Deployment", FULLNAME)


def router_deployment(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(docs, "Deployment", ROUTER)


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
                    "--set", "operator.watchNamespaces={a,b}",
                    "--set", "router.apiKeys.secretName=keys", "--set", "router.forwardKey.secretName=fwd",
                    "--set", "router.tenantLimits={a:rpm=1}", "--set", "router.hostNetwork=true",
                    "--set", "router.verbose=true", "--set", "router.url=https://llm.example.com")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_default_render_holds_exactly_the_operator_and_router_objects(default_docs: list[dict[str, Any]]) -> None:
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in default_docs)
    assert kinds == [
        ("ClusterRole", FULLNAME), ("ClusterRoleBinding", FULLNAME),
        *[("ConfigMap", f"{FULLNAME}-dashboard-{d}") for d in DASHBOARDS],
        ("Deployment", FULLNAME), ("Deployment", ROUTER),
        ("PodDisruptionBudget", ROUTER),
        ("Service", f"{FULLNAME}-metrics"), ("Service", ROUTER),
        ("ServiceAccount", FULLNAME),
    ]
    for doc in default_docs:
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/part-of"] == "mlx-fleet"
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/component"] == (
            "router" if doc["metadata"]["name"] == ROUTER else "operator")
        if doc["kind"] in {"ConfigMap", "Deployment", "Service", "ServiceAccount", "PodDisruptionBudget"}:
            assert doc["metadata"]["namespace"] == NAMESPACE


def test_router_enabled_false_renders_the_operator_alone(helm: Path) -> None:
    docs = render(helm, "--set", "router.enabled=false", "--set", "serviceMonitor.enabled=true")
    assert not [d for d in docs if d["metadata"]["name"] == ROUTER]
    assert not [a for a in _container(docs)["args"] if a.startswith("--router-url")]


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


NAMESPACED_GRANTS = {
    ("mlx-fleet.io", "modeldeployments"): {"get", "list", "watch", "patch", "update"},
    ("mlx-fleet.io", "modeldeployments/status"): {"get", "patch", "update"},
    ("mlx-fleet.io", "modeldeployments/finalizers"): {"get", "patch", "update"},
    ("mlx-fleet.io", "canaries"): {"get", "list", "watch", "patch", "update"},
    ("mlx-fleet.io", "canaries/status"): {"get", "patch", "update"},
    ("", "events"): {"create", "patch"},
    ("events.k8s.io", "events"): {"create", "patch"},
}
CLUSTER_GRANTS = {
    ("mlx-fleet.io", "macnodes"): {"get", "list", "watch", "create", "patch", "update"},
    ("mlx-fleet.io", "macnodes/status"): {"get", "patch", "update"},
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"},
    ("", "namespaces"): {"list", "watch"},  # kopf lists them even for namespaces given by name
}


def _grants(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    return {(g, r): set(rule["verbs"]) for rule in role["rules"]
            for g in rule["apiGroups"] for r in rule["resources"]}


def test_rbac_per_watched_namespace(helm: Path, default_docs: list[dict[str, Any]]) -> None:
    """Watched namespaces by name: the namespaced grants are a Role + RoleBinding in each, the
    ClusterRole keeps only the cluster-scoped ones (MacNodes, CRDs read) — nothing lets the
    operator read a ModelDeployment elsewhere. Cluster-wide it is all one ClusterRole, as
    before."""
    assert _grants(one(default_docs, "ClusterRole")) == {**NAMESPACED_GRANTS, **CLUSTER_GRANTS}
    assert not by_kind(default_docs, "Role") and not by_kind(default_docs, "RoleBinding")

    docs = render(helm, "--set", "operator.watchNamespaces={team-a,team-b}")
    assert _grants(one(docs, "ClusterRole")) == CLUSTER_GRANTS
    roles = {r["metadata"]["namespace"]: r for r in by_kind(docs, "Role")}
    assert set(roles) == {"team-a", "team-b"}
    for ns, role in roles.items():
        assert role["metadata"]["name"] == FULLNAME and _grants(role) == NAMESPACED_GRANTS
    bindings = {b["metadata"]["namespace"]: b for b in by_kind(docs, "RoleBinding")}
    assert set(bindings) == {"team-a", "team-b"}
    for b in bindings.values():
        assert b["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                "name": FULLNAME}
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": FULLNAME,
                                  "namespace": NAMESPACE}]
    one(docs, "ClusterRoleBinding")  # the cluster-scoped grants stay bound
    # peering: a KopfPeering per watched namespace, no ClusterKopfPeering
    peering = render(helm, "--set", "operator.watchNamespaces={team-a}", "--set", "operator.peering=true")
    assert _grants(one(peering, "Role"))[("kopf.dev", "kopfpeerings")] == {"get", "list", "watch", "patch"}
    assert _grants(one(peering, "ClusterRole")) == CLUSTER_GRANTS
    # a pattern can't be enumerated: one ClusterRole, as cluster-wide
    pattern = render(helm, "--set", "operator.watchNamespaces={team-a,team-*}")
    assert not by_kind(pattern, "Role")
    assert _grants(one(pattern, "ClusterRole")) == _grants(one(default_docs, "ClusterRole"))
    assert not by_kind(render(helm, "--set", "rbac.create=false",
                              "--set", "operator.watchNamespaces={team-a}"), "Role")


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
    pod = operator_deployment(default_docs)["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa["name"]


def test_rbac_create_false_renders_no_rbac(helm: Path) -> None:
    docs = render(helm, "--set", "rbac.create=false")
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")


# --- Deployment, Service, options ---------------------------------------------------------------

def _container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    [container] = operator_deployment(docs)["spec"]["template"]["spec"]["containers"]
    return container


def _router_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    [container] = router_deployment(docs)["spec"]["template"]["spec"]["containers"]
    return container


def test_operator_deployment(default_docs: list[dict[str, Any]]) -> None:
    deploy = operator_deployment(default_docs)
    assert deploy["spec"]["replicas"] == 1
    assert deploy["spec"]["strategy"] == {"type": "Recreate"}
    pod = deploy["spec"]["template"]
    assert deploy["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    c = _container(default_docs)
    assert c["image"] == "ghcr.io/mlx-fleet/mlx-fleet-operator:0.1.0"
    assert c["command"] == ["mlx-fleet-operator"]
    assert c["args"] == ["--etcd-endpoint=https://etcd.mlx-fleet.svc:2379",
                         "--etcd-ca-file=/etc/mlx-fleet/etcd-tls/ca.crt",
                         "--etcd-cert-file=/etc/mlx-fleet/etcd-tls/tls.crt",
                         "--etcd-key-file=/etc/mlx-fleet/etcd-tls/tls.key",
                         "--metrics-port=8080", "--liveness-port=8081", "--standalone",
                         f"--router-url=http://{ROUTER}.{NAMESPACE}.svc"]
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
    assert args.etcd_endpoint == "https://etcd.mlx-fleet.svc:2379"
    assert (args.metrics_port, args.liveness_port) == (8080, 8081)
    if flags:
        assert (args.etcd_prefix, args.standalone, args.verbose, args.namespace) == ("/fleet-a", False, True, ["a", "b-*"])
        assert args.peering_name == "mlx-fleet"
    else:
        assert (args.standalone, args.namespace) == (True, [])


def test_operator_runs_non_root_with_a_read_only_root_fs(default_docs: list[dict[str, Any]]) -> None:
    pod = operator_deployment(default_docs)["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    sc = _container(default_docs)["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    # The only writable place is an emptyDir at /tmp (HOME points there); the etcd client
    # certificate (the default: https etcd) is mounted read-only.
    mounts = {m["mountPath"]: m for m in _container(default_docs)["volumeMounts"]}
    assert set(mounts) == {"/tmp", "/etc/mlx-fleet/etcd-tls"}
    assert all(m["readOnly"] for path, m in mounts.items() if path != "/tmp")
    assert {"name": "HOME", "value": "/tmp"} in _container(default_docs)["env"]


def test_metrics_service_selects_the_operator(default_docs: list[dict[str, Any]]) -> None:
    svc = one(default_docs, "Service", f"{FULLNAME}-metrics")
    pod_labels = operator_deployment(default_docs)["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert svc["spec"]["ports"] == [{"name": "metrics", "port": 8080, "targetPort": "metrics", "protocol": "TCP"}]


def test_etcd_endpoint_and_prefix(helm: Path) -> None:
    args = _container(render(helm, "--set", "etcd.endpoints={https://etcd-0:2379}", "--set", "etcd.prefix=/fleet-a"))["args"]
    assert args[:2] == ["--etcd-endpoint=https://etcd-0:2379", "--etcd-prefix=/fleet-a"]


@pytest.mark.parametrize(("flags", "message"), [
    (("--set", "etcd.endpoints=null"), "etcd.endpoints must list one etcd client URL"),
    (("--set", "etcd.endpoints={http://a:2379,http://b:2379}"),
     "etcd.endpoints: the operator accepts exactly one etcd endpoint for now"),
    (("--set", "etcd.endpoints={http://127.0.0.1:2379}", "--set", "etcd.tls.secretName=etcd-client-tls"),
     "etcd.tls.secretName needs an https:// etcd endpoint"),
    (("--set", "etcd.auth.username=mlx-fleet-operator"),
     "etcd.auth.username needs etcd.auth.passwordSecret.name"),
    (("--set", "etcd.tls.secretName="),
     "etcd.endpoints https://etcd.mlx-fleet.svc:2379 is https: etcd.tls.secretName must name the Secret"),
    (("--set", "etcd.endpoints={http://etcd.example:2379}", "--set", "etcd.tls.secretName="),
     "etcd.endpoints http://etcd.example:2379 is plain http to a host that is not loopback: use "
     "https:// with etcd.tls.secretName, or accept the risk with insecure.etcdHttp"),
    (("--set", "etcd.endpoints={http://127.0.0.1:2379}", "--set", "etcd.tls.secretName=",
      "--set", "etcd.auth.username=u", "--set", "etcd.auth.passwordSecret.name=p"),
     "etcd.auth.username: the etcd password would travel in cleartext to http://127.0.0.1:2379"),
    (("--set", "router.apiKeys.secretName="),
     "router.apiKeys.secretName is empty: the router would serve every model to anyone"),
], ids=["no-endpoint", "two-endpoints", "tls-over-http", "user-without-password",
        "https-without-ca", "http-beyond-loopback", "password-over-http", "router-without-keys"])
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
    volumes = {v["name"]: v for v in operator_deployment(docs)["spec"]["template"]["spec"]["volumes"]}
    assert volumes["etcd-tls"]["secret"]["secretName"] == "etcd-client-tls"
    assert volumes["etcd-auth"]["secret"] == {"secretName": "etcd-operator-password",
                                              "defaultMode": 0o400,
                                              "items": [{"key": "password", "path": "password"}]}
    assert not any("password" in e.get("name", "").lower() for e in c["env"])


def test_watch_namespaces_and_peering(helm: Path) -> None:
    docs = render(helm, "--set", "operator.watchNamespaces={team-a,team-*}", "--set", "operator.peering=true",
                  "--set", "operator.verbose=true", "--set", "operator.extraArgs={--foo=bar}")
    assert _container(docs)["args"][-8:] == [
        "--liveness-port=8081", "--namespace=team-a", "--namespace=team-*", "--peering",
        "--peering-name=mlx-fleet", "--verbose", f"--router-url=http://{ROUTER}.{NAMESPACE}.svc",
        "--foo=bar"]


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
    sm = one(docs, "ServiceMonitor", FULLNAME)
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["selector"]["matchLabels"].items() <= one(docs, "Service", f"{FULLNAME}-metrics")["metadata"]["labels"].items()
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


# --- The fleet router ----------------------------------------------------------------------------

def test_router_deployment(default_docs: list[dict[str, Any]]) -> None:
    """Two stateless replicas from the operator's image, surging one at a time, on /health."""
    deploy = router_deployment(default_docs)
    assert deploy["spec"]["replicas"] == 2
    assert deploy["spec"]["strategy"] == {"type": "RollingUpdate",
                                          "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    pod = deploy["spec"]["template"]
    assert deploy["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    # Neither Deployment selects the other's Pods.
    op_pod = operator_deployment(default_docs)["spec"]["template"]["metadata"]["labels"]
    assert not operator_deployment(default_docs)["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert not deploy["spec"]["selector"]["matchLabels"].items() <= op_pod.items()
    assert pod["spec"]["automountServiceAccountToken"] is False
    c = _router_container(default_docs)
    assert c["image"] == _container(default_docs)["image"]
    assert c["command"] == ["mlx-fleet-router"]
    assert c["args"] == ["--listen=0.0.0.0", "--port=8090",
                         "--etcd-endpoint=https://etcd.mlx-fleet.svc:2379",
                         "--etcd-ca-file=/etc/mlx-fleet/etcd-tls/ca.crt",
                         "--etcd-cert-file=/etc/mlx-fleet/etcd-tls/tls.crt",
                         "--etcd-key-file=/etc/mlx-fleet/etcd-tls/tls.key",
                         "--metrics-auth=open",
                         "--tls-cert-file=/etc/mlx-fleet/tls/tls.crt",
                         "--tls-key-file=/etc/mlx-fleet/tls/tls.key",
                         "--api-key-file=/etc/mlx-fleet/api-keys/keys",
                         "--allowed-host=$(POD_IP)"]
    assert c["ports"] == [{"name": "http", "containerPort": 8090, "protocol": "TCP"}]
    values = yaml.safe_load((CHART / "values.yaml").read_text())["router"]
    for kind in ("startup", "liveness", "readiness"):
        probe = c[f"{kind}Probe"]
        # a loopback Host: a router without keys answers only such names (421 otherwise)
        assert probe.pop("httpGet") == {"path": "/health", "port": "http", "scheme": "HTTPS",
                                        "httpHeaders": [{"name": "Host", "value": "localhost"}]}
        assert probe == values["probes"][kind]
    assert c["lifecycle"] == {"preStop": {"sleep": {"seconds": 5}}}
    assert pod["spec"]["terminationGracePeriodSeconds"] == 60
    assert c["resources"] == values["resources"]


def test_router_runs_with_the_operators_hardening(default_docs: list[dict[str, Any]]) -> None:
    op = operator_deployment(default_docs)["spec"]["template"]["spec"]
    router = router_deployment(default_docs)["spec"]["template"]["spec"]
    assert router["securityContext"] == op["securityContext"]
    assert router["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = _router_container(default_docs)["securityContext"]
    assert sc == _container(default_docs)["securityContext"]
    assert (sc["readOnlyRootFilesystem"], sc["allowPrivilegeEscalation"], sc["capabilities"]) == (
        True, False, {"drop": ["ALL"]})
    mounts = {m["mountPath"]: m for m in _router_container(default_docs)["volumeMounts"]}
    assert set(mounts) == {"/tmp", "/etc/mlx-fleet/etcd-tls", "/etc/mlx-fleet/api-keys",
                           "/etc/mlx-fleet/tls"}
    assert all(m["readOnly"] for path, m in mounts.items() if path != "/tmp")
    assert {"name": "HOME", "value": "/tmp"} in _router_container(default_docs)["env"]


def test_router_service_and_disruption_budget(default_docs: list[dict[str, Any]]) -> None:
    svc = one(default_docs, "Service", ROUTER)
    pod_labels = router_deployment(default_docs)["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert svc["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]
    pdb = one(default_docs, "PodDisruptionBudget", ROUTER)
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {
        "matchLabels": router_deployment(default_docs)["spec"]["selector"]["matchLabels"]}}


def test_operator_router_url_follows_the_router(helm: Path) -> None:
    from mlx_fleet_operator.main import build_parser

    def url(*flags: str) -> str | None:
        return build_parser().parse_args(_container(render(helm, *flags))["args"]).router_url

    assert url() == f"http://{ROUTER}.{NAMESPACE}.svc"
    assert url("--set", "router.service.port=8090") == f"http://{ROUTER}.{NAMESPACE}.svc:8090"
    assert url("--set", "router.url=https://llm.example.com/") == "https://llm.example.com"
    assert url("--set", "router.enabled=false", "--set", "router.url=http://mac-1.lan:8090") == "http://mac-1.lan:8090"
    assert url("--set", "router.enabled=false") is None


@pytest.mark.parametrize(("flags", "scope"), [
    ((), []),
    (("--set", "operator.watchNamespaces={team-a,team-b}"), ["team-a", "team-b"]),
    (("--set", "operator.watchNamespaces={team-a,team-*}"), []),
    (("--set", "operator.watchNamespaces={team-*}", "--set", "router.namespaces={team-a}"), ["team-a"]),
], ids=["everywhere", "operators-names", "operator-pattern", "own"])
def test_router_scope(helm: Path, flags: tuple[str, ...], scope: list[str]) -> None:
    from mlx_fleet_router.main import parse_args

    assert parse_args(_router_container(render(helm, *flags))["args"]).namespace == scope


def test_router_args_parse_with_the_routers_own_cli(helm: Path) -> None:
    """Every router value rendered, parsed by mlx-fleet-router's own parser; secrets as files."""
    from mlx_fleet_router.main import parse_args

    docs = render(helm, "--set", "etcd.endpoints={https://etcd.mlx-fleet.svc:2379}",
                  "--set", "etcd.prefix=/fleet-a", "--set", "etcd.tls.secretName=etcd-operator-tls",
                  "--set", "router.etcd.tls.secretName=etcd-router-tls",
                  "--set", "router.etcd.auth.username=mlx-fleet-router",
                  "--set", "router.etcd.auth.passwordSecret.name=etcd-router-password",
                  "--set", "router.apiKeys.secretName=router-keys",
                  "--set", "router.forwardKey.secretName=fleet-forward",
                  "--set", "router.tenantLimits={team-a:rpm=60\\,tpm=10000}",
                  "--set", "router.port=9000", "--set", "router.verbose=true",
                  "--set", "router.extraArgs={--load-factor=1.5}")
    c = _router_container(docs)
    args = parse_args(c["args"])  # exits (SystemExit) on an unknown flag
    assert (args.listen, args.port, args.etcd_endpoint, args.etcd_prefix) == (
        "0.0.0.0", 9000, "https://etcd.mlx-fleet.svc:2379", "/fleet-a")
    assert (args.etcd_ca_file, args.etcd_cert_file, args.etcd_key_file) == (
        "/etc/mlx-fleet/etcd-tls/ca.crt", "/etc/mlx-fleet/etcd-tls/tls.crt",
        "/etc/mlx-fleet/etcd-tls/tls.key")
    assert (args.etcd_username, args.etcd_password_file) == (
        "mlx-fleet-router", "/etc/mlx-fleet/etcd-auth/password")
    assert (args.api_key_file, args.forward_key_file) == (
        "/etc/mlx-fleet/api-keys/keys", "/etc/mlx-fleet/forward-key/keys")
    [(tenant, limits)] = args.tenant_limits
    assert (tenant, limits.requests_per_minute, limits.tokens_per_minute) == ("team-a", 60, 10000)
    assert (args.verbose, args.load_factor) == (True, 1.5)
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert all(m["readOnly"] for path, m in mounts.items() if path != "/tmp")
    assert set(mounts) == {"/tmp", "/etc/mlx-fleet/etcd-tls", "/etc/mlx-fleet/etcd-auth",
                           "/etc/mlx-fleet/api-keys", "/etc/mlx-fleet/forward-key", "/etc/mlx-fleet/tls"}
    volumes = {v["name"]: v for v in router_deployment(docs)["spec"]["template"]["spec"]["volumes"]}
    assert volumes["etcd-tls"]["secret"]["secretName"] == "etcd-router-tls"  # its own, not the operator's
    assert volumes["etcd-auth"]["secret"]["secretName"] == "etcd-router-password"
    assert volumes["api-keys"]["secret"] == {"secretName": "router-keys", "defaultMode": 0o400,
                                             "items": [{"key": "api-keys", "path": "keys"}]}
    assert volumes["forward-key"]["secret"]["items"] == [{"key": "forward-keys", "path": "keys"}]
    assert "subPath" not in json.dumps(c)  # a subPath mount would never see a rotated key
    # The operator keeps its own etcd credentials.
    op_volumes = {v["name"]: v for v in operator_deployment(docs)["spec"]["template"]["spec"]["volumes"]}
    assert op_volumes["etcd-tls"]["secret"]["secretName"] == "etcd-operator-tls"
    assert "etcd-auth" not in op_volumes


def _router_exposure(docs: list[dict[str, Any]]) -> Any:
    """The router's own start-up check (:func:`mlx_fleet.exposure.exposure_check`, as
    ``mlx_fleet_router.main.configure`` runs it) of its rendered arguments."""
    from mlx_fleet.exposure import (INSECURE_ETCD, INSECURE_HTTP_LISTEN, INSECURE_LISTEN,
                                    exposure_check)
    from mlx_fleet_router.main import parse_args

    args = parse_args(_router_container(docs)["args"])
    return exposure_check(
        listen_host=args.listen, api_keys=args.api_key_file is not None,
        etcd_endpoint=args.etcd_endpoint, etcd_password=args.etcd_username is not None,
        tls=args.tls_cert_file is not None,
        insecure=frozenset(f for f in (INSECURE_LISTEN, INSECURE_ETCD, INSECURE_HTTP_LISTEN)
                           if getattr(args, f[2:].replace("-", "_"))))


def test_default_install_is_closed(default_docs: list[dict[str, Any]]) -> None:
    """Defaults: https etcd with a client certificate, a router with keys serving HTTPS (the
    Secret mlx-fleet-router-tls); the router's own check refuses nothing and warns about
    nothing; no --insecure flag anywhere."""
    exposure = _router_exposure(default_docs)
    assert exposure.refusals == () and exposure.warnings == ()
    assert not [a for a in _container(default_docs)["args"] if a.startswith("--insecure")]
    c = _router_container(default_docs)
    assert not [a for a in c["args"] if a.startswith("--insecure")]
    assert "--tls-cert-file=/etc/mlx-fleet/tls/tls.crt" in c["args"]


def test_router_tls_closes_the_last_opt_out(helm: Path) -> None:
    """router.tls.secretName: HTTPS on the router's port (the Secret's tls.crt/tls.key), HTTPS
    probes and scrape, no opt-out and nothing to warn about; without it and without
    insecure.httpListen the chart refuses to render a keyed plain-http router."""
    docs = render(helm, "--set", "router.tls.secretName=router-tls")
    exposure = _router_exposure(docs)
    assert exposure.refusals == () and exposure.warnings == ()
    c = _router_container(docs)
    assert "--tls-cert-file=/etc/mlx-fleet/tls/tls.crt" in c["args"]
    assert "--tls-key-file=/etc/mlx-fleet/tls/tls.key" in c["args"]
    assert not [a for a in c["args"] if a.startswith("--insecure")]
    assert c["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    volumes = {v["name"]: v for v in router_deployment(docs)["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "router-tls"
    failed = run_helm(helm, "template", RELEASE, str(CHART), "--set", "router.tls.secretName=")
    assert failed.returncode != 0 and "insecure.httpListen" in failed.stderr
    # the explicit opt-out: plain http, rendered and warned about at start
    opened = _router_exposure(render(helm, "--set", "router.tls.secretName=",
                                     "--set", "insecure.httpListen=true"))
    assert [w.split(")")[0] for w in opened.warnings] == ["INSECURE (--insecure-http-listen"]


def test_router_metrics_auth_renders_and_open_metrics_allow_the_pod_ip(helm: Path) -> None:
    """router.metricsAuth: `open` by default (the ServiceMonitor scrapes without a key, by the
    Pod's IP, which the open /metrics's Host check then accepts); `api-key` renders the flag."""
    from mlx_fleet_router.main import parse_args

    default = _router_container(render(helm))
    args = parse_args(default["args"])
    assert args.metrics_auth == "open" and "$(POD_IP)" in args.allowed_host
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} \
        in default["env"]
    keyed = parse_args(_router_container(render(helm, "--set", "router.metricsAuth=api-key"))["args"])
    assert keyed.metrics_auth == "api-key" and "$(POD_IP)" not in keyed.allowed_host


def test_insecure_opt_outs_render_the_routers_flags(helm: Path) -> None:
    """Each opt-out is the router's flag of the same name, so it starts (with a warning) where
    it would otherwise refuse; without keys only loopback and its Service's names are Host."""
    from mlx_fleet_router.main import parse_args

    docs = render(helm, "--set", "etcd.endpoints={http://etcd.example:2379}",
                  "--set", "etcd.tls.secretName=", "--set", "insecure.etcdHttp=true",
                  "--set", "router.apiKeys.secretName=", "--set", "insecure.listenWithoutKeys=true",
                  "--set", "insecure.forwardHttp=true", "--set", "router.url=https://llm.example.com/")
    exposure = _router_exposure(docs)
    assert exposure.refusals == () and len(exposure.warnings) == 2
    args = parse_args(_router_container(docs)["args"])
    assert args.insecure_forward_http is True
    assert args.allowed_host == [ROUTER, f"{ROUTER}.{NAMESPACE}", f"{ROUTER}.{NAMESPACE}.svc",
                                 f"{ROUTER}.{NAMESPACE}.svc.cluster.local", "llm.example.com"]
    assert "api-keys" not in {v["name"] for v in
                              router_deployment(docs)["spec"]["template"]["spec"]["volumes"]}
    # plain http to loopback needs no opt-out (the agents' rule)
    loopback = render(helm, "--set", "etcd.endpoints={http://127.0.0.1:2379}",
                      "--set", "etcd.tls.secretName=")
    assert _router_exposure(loopback).refusals == ()
    assert "--insecure-etcd-http" not in _router_container(loopback)["args"]


def _operator_etcd_exposure(docs: list[dict[str, Any]]) -> Any:
    """The operator's own start-up etcd check (``check_etcd_exposure`` as its ``main`` runs
    it) of its rendered arguments: a PreflightError, or the warnings it would log."""
    from mlx_fleet.etcd_credentials import EtcdCredentials
    from mlx_fleet_operator.main import PreflightError, build_parser, check_etcd_exposure

    args = build_parser().parse_args(_container(docs)["args"])
    creds = (EtcdCredentials(username=args.etcd_username, password="from-the-secret")
             if args.etcd_username else EtcdCredentials())
    try:
        return check_etcd_exposure(args, creds)
    except PreflightError as e:
        return e


def test_operator_gets_the_etcd_opt_out_with_the_value(helm: Path) -> None:
    """insecure.etcdHttp reaches the operator as --insecure-etcd-http, so it starts (with a
    warning) where its own check would refuse the plain-http, non-loopback etcd; on loopback
    http no flag is rendered and none is needed."""
    docs = render(helm, "--set", "etcd.endpoints={http://etcd.example:2379}",
                  "--set", "etcd.tls.secretName=", "--set", "insecure.etcdHttp=true")
    assert "--insecure-etcd-http" in _container(docs)["args"]
    warnings = _operator_etcd_exposure(docs)
    assert isinstance(warnings, tuple) and len(warnings) == 1
    assert "INSECURE (--insecure-etcd-http)" in warnings[0]
    # without the flag the operator's own check refuses the same endpoint
    _container(docs)["args"].remove("--insecure-etcd-http")
    assert "--insecure-etcd-http" in str(_operator_etcd_exposure(docs))
    loopback = render(helm, "--set", "etcd.endpoints={http://127.0.0.1:2379}",
                      "--set", "etcd.tls.secretName=")
    assert "--insecure-etcd-http" not in _container(loopback)["args"]
    assert _operator_etcd_exposure(loopback) == ()


def test_local_node_values_set_their_opt_outs_explicitly(helm: Path) -> None:
    """mlx_fleet.devcluster.chart.local_values (demo --node, dev up --node): the chart renders
    with them and the router's own check accepts what it is given."""
    from types import SimpleNamespace

    from mlx_fleet.devcluster.chart import local_values

    cp = SimpleNamespace(etcd_url="http://127.0.0.1:2379", apiserver_url="https://127.0.0.1:6443")
    values = local_values(cp, SimpleNamespace(kube_proxy=object()), namespace="ns",  # type: ignore[arg-type]
                          etcd_prefix="/p", metrics_port=1, health_port=2, router_port=3)
    docs = render(helm, *values)
    exposure = _router_exposure(docs)
    assert exposure.refusals == ()
    assert [w.split(")")[0] for w in exposure.warnings] == ["INSECURE (--insecure-listen-without-keys"]
    assert _operator_etcd_exposure(docs) == ()  # loopback etcd: the operator needs no opt-out


def test_router_inherits_the_operators_etcd_credentials(helm: Path) -> None:
    from mlx_fleet_router.main import parse_args

    docs = render(helm, "--set", "etcd.auth.username=mlx-fleet-operator",
                  "--set", "etcd.auth.passwordSecret.name=etcd-operator-password")
    args = parse_args(_router_container(docs)["args"])
    assert (args.etcd_username, args.etcd_password_file) == (
        "mlx-fleet-operator", "/etc/mlx-fleet/etcd-auth/password")
    volumes = {v["name"]: v for v in router_deployment(docs)["spec"]["template"]["spec"]["volumes"]}
    assert volumes["etcd-auth"]["secret"]["secretName"] == "etcd-operator-password"


@pytest.mark.parametrize(("flags", "message"), [
    (("--set", "etcd.endpoints={http://127.0.0.1:2379}", "--set", "etcd.tls.secretName=",
      "--set", "router.etcd.tls.secretName=etcd-router-tls"),
     "etcd.tls.secretName needs an https:// etcd endpoint"),
    (("--set", "router.etcd.auth.username=mlx-fleet-router"),
     "router.etcd.auth.username needs router.etcd.auth.passwordSecret.name"),
], ids=["tls-over-http", "user-without-password"])
def test_unsupported_router_etcd_values_fail_with_a_message(helm: Path, flags: tuple[str, ...],
                                                            message: str) -> None:
    proc = run_helm(helm, "template", RELEASE, str(CHART), *flags)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


def test_router_service_monitor_scrapes_its_http_port(helm: Path) -> None:
    docs = render(helm, "--set", "serviceMonitor.enabled=true", "--set", "serviceMonitor.labels.release=prom")
    sm = one(docs, "ServiceMonitor", ROUTER)
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["selector"]["matchLabels"].items() <= one(docs, "Service", ROUTER)["metadata"]["labels"].items()
    assert not sm["spec"]["selector"]["matchLabels"].items() <= one(
        docs, "Service", f"{FULLNAME}-metrics")["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "scheme": "https",
                                        "interval": "30s", "scrapeTimeout": "10s"}]


def test_router_options(helm: Path) -> None:
    docs = render(helm, "--set", "router.replicaCount=3", "--set", "router.podDisruptionBudget.maxUnavailable=2",
                  "--set", "router.service.type=LoadBalancer", "--set", "router.preStopSleepSeconds=0",
                  "--set", "router.nodeSelector.pool=cpu",
                  "--set", "router.updateStrategy.rollingUpdate.maxSurge=0",
                  "--set", "router.updateStrategy.rollingUpdate.maxUnavailable=1")
    deploy = router_deployment(docs)
    assert deploy["spec"]["replicas"] == 3
    assert deploy["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert deploy["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "cpu"}
    assert "lifecycle" not in _router_container(docs)
    assert one(docs, "PodDisruptionBudget", ROUTER)["spec"]["maxUnavailable"] == 2
    assert one(docs, "Service", ROUTER)["spec"]["type"] == "LoadBalancer"
    assert not by_kind(render(helm, "--set", "router.podDisruptionBudget.enabled=false"), "PodDisruptionBudget")


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
    (("--set", "router.enabled=yes"), "at '/router/enabled': got string, want boolean"),
    (("--set", "router.namespaces={team-*}"), "at '/router/namespaces/0'"),
    (("--set", "router.url=mac-1:8090"), "at '/router/url'"),
    (("--set", "router.tenantLimits={team-a:rps=5}"), "at '/router/tenantLimits/0'"),
    (("--set", "router.apiKeys.secretName=Keys"), "at '/router/apiKeys/secretName'"),
    (("--set", "router.probes.liveness.periodSeconds=0"), "at '/router/probes/liveness/periodSeconds'"),
    (("--set", "router.replicas=2"), "additional properties 'replicas' not allowed"),
    (("--set", "insecure.etcdHTTP=true"), "additional properties 'etcdHTTP' not allowed"),
    (("--set", "insecure.listenWithoutKeys=yes"), "at '/insecure/listenWithoutKeys': got string, want boolean"),
], ids=["negative-replicas", "port-not-int", "pull-policy", "endpoint-scheme", "interval-unit",
        "typo", "dns-policy", "host-network-bool", "api-host-not-url", "probe-period",
        "probe-handler-fixed", "router-enabled-bool", "router-scope-pattern", "router-url-scheme",
        "tenant-limit-unit", "api-keys-secret-name", "router-probe-period", "router-typo",
        "insecure-typo", "insecure-bool"])
def test_values_schema_rejects_bad_values_with_a_message(helm: Path, flags: tuple[str, ...],
                                                         message: str) -> None:
    proc = run_helm(helm, "template", RELEASE, str(CHART), *flags)
    assert proc.returncode != 0
    assert "values don't meet the specifications of the schema" in proc.stderr, proc.stderr
    assert message in proc.stderr, proc.stderr


def test_source_policy_reaches_the_operator_as_the_same_record(helm: Path) -> None:
    """Issue 19: ``sourcePolicy`` renders as one --source-policy flag holding the record (the
    one the agents are given), which the operator's own CLI parses into the same policy;
    empty (the default) renders no flag: the operator's secure default."""
    from mlx_fleet.source_policy import DEFAULT_POLICY, parse_policy
    from mlx_fleet_operator.main import _source_policy, build_parser

    record = {"fileRoots": ["/Volumes/models"], "httpsHosts": ["models.example.com",
                                                               "*.cdn.example.net:8443"],
              "hfOrganizations": ["mlx-community"], "allowPrivateNetworks": True,
              "maxRedirects": 2}
    c = _container(render(helm, "--set-json", f"sourcePolicy={json.dumps(record)}"))
    [flag] = [a for a in c["args"] if a.startswith("--source-policy")]
    args = build_parser().parse_args(c["args"])
    assert _source_policy(args.source_policy) == parse_policy(record)
    default = _container(render(helm))
    assert not [a for a in default["args"] if a.startswith("--source-policy")]
    assert _source_policy(build_parser().parse_args(default["args"]).source_policy) \
        == DEFAULT_POLICY
    for bad, where in [('{"schemes": ["http"]}', "/sourcePolicy/schemes/0"),
                       ('{"fileRoots": ["relative"]}', "/sourcePolicy/fileRoots/0"),
                       ('{"allowPrivate": true}', "'allowPrivate' not allowed")]:
        proc = run_helm(helm, "template", RELEASE, str(CHART), "--set-json",
                        f"sourcePolicy={bad}")
        assert proc.returncode != 0 and where in proc.stderr, proc.stderr


def test_host_network_and_dns_policy(helm: Path, default_docs: list[dict[str, Any]]) -> None:
    pod = operator_deployment(default_docs)["spec"]["template"]["spec"]
    assert "hostNetwork" not in pod and "dnsPolicy" not in pod  # the cluster's defaults
    pod = operator_deployment(render(helm, "--set", "hostNetwork=true"))["spec"]["template"]["spec"]
    assert (pod["hostNetwork"], pod["dnsPolicy"]) == (True, "ClusterFirstWithHostNet")
    pod = operator_deployment(render(helm, "--set", "hostNetwork=true", "--set", "dnsPolicy=Default")
                              )["spec"]["template"]["spec"]
    assert (pod["hostNetwork"], pod["dnsPolicy"]) == (True, "Default")
    # The router's network is its own value: the operator's hostNetwork leaves it alone.
    router = router_deployment(render(helm, "--set", "hostNetwork=true"))["spec"]["template"]["spec"]
    assert "hostNetwork" not in router and "dnsPolicy" not in router
    router = router_deployment(render(helm, "--set", "router.hostNetwork=true"))["spec"]["template"]["spec"]
    assert (router["hostNetwork"], router["dnsPolicy"]) == (True, "ClusterFirstWithHostNet")


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
    # closed by default: https etcd with a client certificate, router keys, no opt-out
    assert values["etcd"]["endpoints"] == ["https://etcd.mlx-fleet.svc:2379"]
    assert values["etcd"]["tls"]["secretName"] == "mlx-fleet-etcd-client"
    assert values["etcd"]["auth"]["username"] == ""
    assert values["insecure"] == {"etcdHttp": False, "listenWithoutKeys": False, "forwardHttp": False,
                                  "httpListen": False}
    assert values["router"]["tls"]["secretName"] == "mlx-fleet-router-tls"
    assert values["operator"]["peering"] is False
    assert set(values["image"]) == {"repository", "tag", "pullPolicy"}
    router = values["router"]
    assert router["enabled"] is True and router["replicaCount"] >= 2
    assert router["url"] == "" and router["apiKeys"]["secretName"] == "mlx-fleet-router-api-keys"
    assert router["podDisruptionBudget"] == {"enabled": True, "maxUnavailable": 1}


def test_notes_say_kopf_peering_crds_must_be_installed() -> None:
    # Rendered only with operator.peering=true; a server dry run of that release fails without
    # kopf's CRDs (the point of the note), so the template text is checked here.
    notes = (CHART / "templates" / "NOTES.txt").read_text()
    assert "{{- if .Values.operator.peering }}" in notes
    assert "CRDs (clusterkopfpeerings.kopf.dev, kopfpeerings.kopf.dev) must be installed" in notes.replace("\n", " ")
