"""The Helm chart's RBAC, in practice: the operator runs as the chart's ServiceAccount.

The chart is rendered with ``helm template``; only its ServiceAccount, ClusterRole and
ClusterRoleBinding (and, with ``operator.watchNamespaces``, its Role and RoleBinding per watched
namespace) are applied to the real local kube-apiserver. The operator runs as the chart rendered
for its one watched namespace (RBAC per namespace, issue 19); the cluster-wide rendering is
checked with ``kubectl auth can-i`` as well. A token for that ServiceAccount
(TokenRequest, ``kubectl create token``) goes into a kubeconfig of its own, and the operator runs
with it through a whole ModelDeployment lifecycle: placement, status patched to Ready, an Event
posted, and the finalizer removed on deletion — and through two Canaries of it: one whose
candidate never becomes Ready (no agent serves it), aborted by its annotation and deleted; one
promoted by the promote-full annotation (the operator patches the ModelDeployment's spec) that
succeeds once the new revision is Ready. The operator must never have been refused (no
403/Forbidden in its log), and the ServiceAccount must not be able to do what it need not do.

The test plays the node agent (node record and report under a lease in etcd). No sleeps: etcd
changes are awaited with an etcd watch, Kubernetes changes with ``kubectl wait`` (an API watch).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import tempfile
import uuid
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from fleet_helpers import node_record, stub_manifest, until_assignments, watch_until
from mlx_fleet.contract import Assignment, AssignmentReport, AssignmentState, Role
from mlx_fleet.devcluster.fleet import start_operator
from mlx_fleet.devcluster.helm import ensure_helm
from mlx_fleet.store import EtcdStore

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "mlx-fleet"
RELEASE = "mlx-fleet"
RBAC_KINDS = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
TIMEOUT = 60.0
NODE = "mac-rbac"


def helm_env() -> dict[str, str]:
    home = Path(tempfile.gettempdir()) / "mlx-fleet-helm"
    return {**os.environ, **{f"HELM_{k}_HOME": str(home / k.lower()) for k in ("CACHE", "CONFIG", "DATA")}}


def render_rbac(namespace: str, *flags: str) -> list[dict[str, Any]]:
    """``helm template`` the chart into ``namespace`` (with ``flags``); keep only its RBAC
    documents."""
    proc = subprocess.run([str(ensure_helm()), "template", RELEASE, str(CHART), "--namespace", namespace,
                           *flags], cwd=REPO, capture_output=True, text=True, env=helm_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d and d.get("kind") in RBAC_KINDS]
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(RBAC_KINDS if flags else RBAC_KINDS - {"Role", "RoleBinding"}), docs
    return docs


@pytest.fixture(scope="module")
def chart_rbac(control_plane, namespace):
    """The chart's RBAC rendered for an operator watching the module namespace alone (a Role
    and RoleBinding there, the cluster-scoped grants in the ClusterRole), applied; yields the
    ServiceAccount's name."""
    yield from _apply_rbac(control_plane, namespace,
                           "--set", f"operator.watchNamespaces={{{namespace}}}")


@pytest.fixture(scope="module")
def clusterwide_namespace(control_plane) -> Iterator[str]:
    ns = f"t-{uuid.uuid4().hex[:8]}"
    control_plane.kubectl("create", "namespace", ns)
    yield ns
    control_plane.kubectl("delete", "namespace", ns, "--wait=false", check=False)


@pytest.fixture(scope="module")
def chart_rbac_clusterwide(control_plane, clusterwide_namespace):
    """The chart's default (cluster-wide) RBAC, installed into a namespace of its own."""
    yield from _apply_rbac(control_plane, clusterwide_namespace)


def _apply_rbac(control_plane, namespace: str, *flags: str) -> Iterator[str]:
    """The chart's RBAC rendered with ``flags`` applied; yields the ServiceAccount's name. The
    cluster-scoped objects are removed afterwards."""
    docs = render_rbac(namespace, *flags)
    # The ClusterRole/Binding are cluster-scoped: give them names unique to this module so a
    # concurrent session or module applying the chart is never disturbed.
    suffix = namespace
    for d in docs:
        if d["kind"] == "ClusterRole":
            role = d["metadata"]["name"]
            d["metadata"]["name"] = f"{role}-{suffix}"
        elif d["kind"] == "ClusterRoleBinding":
            d["metadata"]["name"] = f"{d['metadata']['name']}-{suffix}"
    for d in docs:
        if d["kind"] == "ClusterRoleBinding":
            assert d["roleRef"]["name"] == role
            d["roleRef"]["name"] = f"{role}-{suffix}"
    [sa] = [d for d in docs if d["kind"] == "ServiceAccount"]
    assert sa["metadata"]["namespace"] == namespace
    control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
    yield sa["metadata"]["name"]
    for d in docs:
        if d["kind"] != "ServiceAccount":
            where = ("-n", d["metadata"]["namespace"]) if d["metadata"].get("namespace") else ()
            control_plane.kubectl("delete", d["kind"].lower(), d["metadata"]["name"], *where,
                                  "--ignore-not-found", check=False)


@pytest.fixture(scope="module")
def sa_kubeconfig(control_plane, namespace, chart_rbac, tmp_path_factory) -> Path:
    """A kubeconfig authenticating as the chart's ServiceAccount (a TokenRequest token), with the
    admin kubeconfig's cluster entry (server + CA)."""
    return _kubeconfig(control_plane, namespace, chart_rbac, tmp_path_factory)


@pytest.fixture(scope="module")
def clusterwide_sa_kubeconfig(control_plane, clusterwide_namespace, chart_rbac_clusterwide,
                              tmp_path_factory) -> Path:
    return _kubeconfig(control_plane, clusterwide_namespace, chart_rbac_clusterwide,
                       tmp_path_factory)


def _kubeconfig(control_plane, namespace: str, sa: str, tmp_path_factory) -> Path:
    token = control_plane.kubectl("create", "token", sa, "-n", namespace,
                                  "--duration=1h").stdout.strip()
    assert token
    admin = json.loads(Path(control_plane.kubeconfig).read_text())
    ctx = next(c for c in admin["contexts"] if c["name"] == admin["current-context"])["context"]
    cluster = next(c for c in admin["clusters"] if c["name"] == ctx["cluster"])
    path = tmp_path_factory.mktemp("sa") / "kubeconfig"
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [cluster],
        "users": [{"name": "operator-sa", "user": {"token": token}}],
        "contexts": [{"name": "operator-sa", "context": {"cluster": cluster["name"], "user": "operator-sa",
                                                           "namespace": namespace}}],
        "current-context": "operator-sa",
    }, indent=2))
    path.chmod(0o600)
    return path


def kubectl_as(control_plane, kubeconfig: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(control_plane.binaries.kubectl), "--kubeconfig", str(kubeconfig), *args],
                          capture_output=True, text=True, timeout=60)


def can_i(control_plane, kubeconfig: Path, *args: str) -> str:
    r = kubectl_as(control_plane, kubeconfig, "auth", "can-i", *args)
    answer = r.stdout.strip()
    assert answer in ("yes", "no"), (r.stdout, r.stderr)
    return answer


def test_serviceaccount_is_least_privilege(control_plane, clusterwide_namespace,
                                          clusterwide_sa_kubeconfig):
    """What the operator needs: yes. What it must not have: no. (The chart's default: an
    operator watching every namespace.)"""
    namespace, sa_kubeconfig = clusterwide_namespace, clusterwide_sa_kubeconfig
    ns = ("-n", namespace)
    allowed = [
        ("get", "modeldeployments.mlx-fleet.io"), ("list", "modeldeployments.mlx-fleet.io"),
        ("watch", "modeldeployments.mlx-fleet.io"), ("patch", "modeldeployments.mlx-fleet.io"),
        ("patch", "modeldeployments.mlx-fleet.io/status"), ("create", "events"),
        ("create", "events.events.k8s.io"),
        ("get", "canaries.mlx-fleet.io"), ("list", "canaries.mlx-fleet.io"),
        ("watch", "canaries.mlx-fleet.io"), ("patch", "canaries.mlx-fleet.io"),
        ("patch", "canaries.mlx-fleet.io/status"),
    ]
    denied = [
        ("create", "pods"), ("get", "secrets"), ("list", "secrets"), ("create", "deployments.apps"),
        ("create", "modeldeployments.mlx-fleet.io"), ("delete", "modeldeployments.mlx-fleet.io"),
        ("create", "canaries.mlx-fleet.io"), ("delete", "canaries.mlx-fleet.io"),
        ("delete", "events"), ("create", "serviceaccounts/token"),
        ("create", "clusterroles.rbac.authorization.k8s.io"),
        ("escalate", "clusterroles.rbac.authorization.k8s.io"),
        ("impersonate", "serviceaccounts"),
    ]
    for verb, resource in allowed:
        assert can_i(control_plane, sa_kubeconfig, verb, resource, *ns) == "yes", (verb, resource)
    for verb, resource in denied:
        assert can_i(control_plane, sa_kubeconfig, verb, resource, *ns) == "no", (verb, resource)
    # The Mac mirror: cluster-scoped MacNodes are created and their status written, never
    # deleted (a gone Mac is kept with health Gone; a person deletes it).
    for verb, resource in (("create", "macnodes.mlx-fleet.io"), ("patch", "macnodes.mlx-fleet.io"),
                           ("watch", "macnodes.mlx-fleet.io"),
                           ("patch", "macnodes.mlx-fleet.io/status")):
        assert can_i(control_plane, sa_kubeconfig, verb, resource) == "yes", (verb, resource)
    assert can_i(control_plane, sa_kubeconfig, "delete", "macnodes.mlx-fleet.io") == "no"
    # At start-up the operator lists the running Canaries of every namespace.
    assert can_i(control_plane, sa_kubeconfig, "list", "canaries.mlx-fleet.io",
                 "--all-namespaces") == "yes"
    # Not a wildcard role.
    assert can_i(control_plane, sa_kubeconfig, "*", "*", "--all-namespaces") == "no"
    assert can_i(control_plane, sa_kubeconfig, "create", "namespaces") == "no"


def test_serviceaccount_is_confined_to_its_watched_namespaces(control_plane, namespace,
                                                              clusterwide_namespace, sa_kubeconfig):
    """Issue 19, finding 12: with ``operator.watchNamespaces`` the operator's ServiceAccount
    reads and patches ModelDeployments and Canaries in the watched namespace only — not in
    another namespace, not cluster-wide — while the cluster-scoped MacNodes and CRDs stay
    readable (the lifecycle test below runs the operator as this ServiceAccount)."""
    namespaced = [(verb, resource) for resource in ("modeldeployments.mlx-fleet.io",
                                                    "canaries.mlx-fleet.io")
                  for verb in ("get", "list", "watch", "patch")] + [
        ("patch", "modeldeployments.mlx-fleet.io/status"), ("create", "events")]
    for verb, resource in namespaced:
        assert can_i(control_plane, sa_kubeconfig, verb, resource, "-n", namespace) == "yes", \
            (verb, resource)
        for elsewhere in (clusterwide_namespace, "default"):
            assert can_i(control_plane, sa_kubeconfig, verb, resource, "-n", elsewhere) == "no", \
                (verb, resource, elsewhere)
        assert can_i(control_plane, sa_kubeconfig, verb, resource, "--all-namespaces") == "no", \
            (verb, resource)
    # and really refused, not only by the can-i review
    r = kubectl_as(control_plane, sa_kubeconfig, "get", "modeldeployments", "-n",
                   clusterwide_namespace)
    assert r.returncode != 0 and "forbidden" in r.stderr.lower(), r.stderr
    for verb, resource in (("create", "macnodes.mlx-fleet.io"), ("watch", "macnodes.mlx-fleet.io"),
                           ("patch", "macnodes.mlx-fleet.io/status"),
                           ("list", "customresourcedefinitions.apiextensions.k8s.io")):
        assert can_i(control_plane, sa_kubeconfig, verb, resource) == "yes", (verb, resource)
    assert can_i(control_plane, sa_kubeconfig, "create", "namespaces") == "no"
    assert can_i(control_plane, sa_kubeconfig, "get", "secrets", "-n", namespace) == "no"




def canary_manifest(name: str, namespace: str, target: str, revision: str) -> str:
    return json.dumps({
        "apiVersion": "mlx-fleet.io/v1alpha1", "kind": "Canary",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"targetRef": {"name": target}, "candidate": {"revision": revision}},
    })


async def admin(control_plane, *args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
    r = await asyncio.to_thread(control_plane.kubectl, *args, input=input, check=False, timeout=TIMEOUT + 30)
    assert r.returncode == 0, f"kubectl {' '.join(args)}: {r.stderr}"
    return r


async def test_operator_lifecycle_as_the_chart_serviceaccount(control_plane, namespace, keys, sa_kubeconfig):
    log_path = control_plane.logs_dir / "operator.log"
    offset = log_path.stat().st_size if log_path.exists() else 0
    proc = start_operator(control_plane, etcd_prefix=keys.root,
                          extra_args=("--namespace", namespace, "--standalone", "--verbose"),
                          env={"KUBECONFIG": str(sa_kubeconfig)})
    name = f"llm-{uuid.uuid4().hex[:6]}"
    try:
        async with EtcdStore(control_plane.etcd_url) as store:
            lease = await store.grant_lease(60)
            try:
                await store.put(keys.node(NODE), node_record(NODE).to_json(), lease=lease)
                await admin(control_plane, "apply", "-f", "-", input=stub_manifest(name, namespace))

                placed = await until_assignments(store, keys, lambda v: NODE in v)
                asg = placed[NODE]
                assert (asg.namespace, asg.name) == (namespace, name)

                await store.put(keys.report(NODE, namespace, name, "v1"), AssignmentReport(
                    node=NODE, namespace=namespace, name=name, generation=asg.generation,
                    revision="v1", state=AssignmentState.READY, reason="ModelLoaded",
                    endpoint=f"http://{NODE}.local:8000").to_json(), lease=lease)
                # Status patched by the ServiceAccount's operator (status subresource).
                await admin(control_plane, "wait", f"modeldeployment/{name}", "-n", namespace,
                            "--for=condition=Ready", f"--timeout={int(TIMEOUT)}s")
                obj = json.loads((await admin(control_plane, "get", "modeldeployment", name, "-n",
                                              namespace, "-o", "json")).stdout)
                assert obj["status"]["readyReplicas"] == 1
                assert "mlx-fleet.io/finalizer" in obj["metadata"]["finalizers"]

                # The Mac mirror, created and kept by the ServiceAccount's operator.
                # (created by the mirror's next round: wait for it to exist first, since
                # `kubectl wait --for=jsonpath` fails at once on an object not there yet)
                await admin(control_plane, "wait", f"macnode/{NODE}", "--for=create",
                            f"--timeout={int(TIMEOUT)}s")
                await admin(control_plane, "wait", f"macnode/{NODE}",
                            "--for=jsonpath={.status.health}=Healthy",
                            f"--timeout={int(TIMEOUT)}s")
                mac = json.loads((await admin(control_plane, "get", "macnode", NODE, "-o",
                                              "json")).stdout)
                assert mac["status"]["loadedModels"] == [f"{namespace}/{name}@v1"]

                # Events posted by the ServiceAccount.
                events = json.loads((await admin(
                    control_plane, "get", "events", "-n", namespace, "--field-selector",
                    f"involvedObject.name={name}", "-o", "json")).stdout)["items"]
                reasons = {e["reason"] for e in events}
                assert {"Placed", "ReplicaReady"} <= reasons, reasons

                v1_key = keys.assignment(NODE, namespace, name, "v1")
                v2_key = keys.assignment(NODE, namespace, name, "v2")
                split_key = keys.traffic(namespace, name)

                def role_of(key: str, view: dict[str, bytes]) -> Role | None:
                    return Assignment.from_json(view[key]).role if key in view else None

                async def wait_canary(canary: str, phase: str) -> None:
                    await admin(control_plane, "wait", f"canary/{canary}", "-n", namespace,
                                f"--for=jsonpath={{.status.phase}}={phase}",
                                f"--timeout={int(TIMEOUT)}s")

                # Canary 1: its candidate is placed but never Ready (no agent serves it);
                # aborted by annotation, then deleted (the operator removes its finalizer).
                aborted = f"{name}-abort"
                await admin(control_plane, "apply", "-f", "-",
                            input=canary_manifest(aborted, namespace, name, "v2"))
                await wait_canary(aborted, "Pending")
                view = await watch_until(store, keys.assignments_prefix,
                                         lambda v: v2_key in v)
                assert (role_of(v1_key, view), role_of(v2_key, view)) == (
                    Role.STABLE, Role.CANDIDATE)
                await watch_until(store, keys.traffic_prefix, lambda v: split_key in v)
                await admin(control_plane, "annotate", "canary", aborted, "-n", namespace,
                            "--overwrite", "mlx-fleet.io/abort=1")
                await wait_canary(aborted, "Aborted")
                view = await watch_until(store, keys.assignments_prefix,
                                         lambda v: v2_key not in v)
                assert set(view) == {v1_key}  # the candidate is unloaded, stable untouched
                await watch_until(store, keys.traffic_prefix, lambda v: split_key not in v)
                await admin(control_plane, "delete", "canary", aborted, "-n", namespace,
                            "--wait=true", f"--timeout={int(TIMEOUT)}s")

                # Canary 2: promoted at once by annotation. The operator patches the
                # ModelDeployment's spec.model.revision; once v2 is Ready it has succeeded.
                promoted = f"{name}-promote"
                await admin(control_plane, "apply", "-f", "-",
                            input=canary_manifest(promoted, namespace, name, "v2"))
                await wait_canary(promoted, "Pending")
                await admin(control_plane, "annotate", "canary", promoted, "-n", namespace,
                            "--overwrite", "mlx-fleet.io/promote-full=1")
                await admin(control_plane, "wait", f"modeldeployment/{name}", "-n", namespace,
                            "--for=jsonpath={.spec.model.revision}=v2",
                            f"--timeout={int(TIMEOUT)}s")
                view = await watch_until(store, keys.assignments_prefix,
                                         lambda v: role_of(v2_key, v) == Role.STABLE)
                v2 = Assignment.from_json(view[v2_key])
                await store.put(keys.report(NODE, namespace, name, "v2"), AssignmentReport(
                    node=NODE, namespace=namespace, name=name, generation=v2.generation,
                    revision="v2", state=AssignmentState.READY, reason="ModelLoaded",
                    endpoint=f"http://{NODE}.local:8000").to_json(), lease=lease)
                await wait_canary(promoted, "Succeeded")
                view = await watch_until(store, keys.assignments_prefix,
                                         lambda v: set(v) == {v2_key})
                assert role_of(v2_key, view) == Role.STABLE
                await admin(control_plane, "wait", f"modeldeployment/{name}", "-n", namespace,
                            "--for=jsonpath={.status.updatedReplicas}=1",
                            f"--timeout={int(TIMEOUT)}s")
                await admin(control_plane, "delete", "canary", promoted, "-n", namespace,
                            "--wait=true", f"--timeout={int(TIMEOUT)}s")

                # Deletion completes: the operator (as the SA) removed its finalizer.
                await admin(control_plane, "delete", "modeldeployment", name, "-n", namespace,
                            "--wait=true", f"--timeout={int(TIMEOUT)}s")
                r = await asyncio.to_thread(control_plane.kubectl, "get", "modeldeployment", name,
                                            "-n", namespace, check=False)
                assert r.returncode != 0 and "NotFound" in r.stderr, (r.stdout, r.stderr)
                await until_assignments(store, keys, lambda v: not v)

                # The Canaries' transitions were posted as events by the ServiceAccount.
                for canary, expected in ((aborted, {"Started", "Aborted"}),
                                         (promoted, {"Started", "Promoting", "Succeeded"})):
                    events = json.loads((await admin(
                        control_plane, "get", "events", "-n", namespace, "--field-selector",
                        f"involvedObject.name={canary}", "-o", "json")).stdout)["items"]
                    reasons = {e["reason"] for e in events}
                    assert expected <= reasons, (canary, reasons)
            finally:
                await store.revoke_lease(lease)
    finally:
        code = proc.stop()
        control_plane.kubectl("delete", "macnode", NODE, "--ignore-not-found", check=False)
    with log_path.open("rb") as f:
        f.seek(offset)
        log = f.read().decode(errors="replace")
    assert code == 0, f"operator exited with {code} on SIGTERM\n{log[-4000:]}"
    # Every API refusal carries reason "Forbidden" and HTTP status 403. A bare "403" is not
    # enough: log timestamps end in milliseconds and verbose logs carry etcd revisions.
    refusal = re.compile(r"forbidden|(?:status|code)\W{0,4}403\b|\b403,\s*message", re.IGNORECASE)
    refused = [line for line in log.splitlines() if refusal.search(line)]
    assert not refused, "operator was refused by the API server:\n" + "\n".join(refused)
    assert name in log  # the log read is this operator's, and it handled the object
