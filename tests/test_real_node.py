"""The chart's Pods running for real: a kubelet node in the local cluster (issue 18).

The pure parts of :mod:`mlx_fleet.devcluster.node` are table-tested first. The integration test
then does what a user does on a real cluster, offline: build the operator image from the
repository's Dockerfile (no registry) and import it into the node's containerd, ``helm install``
the chart with its CRDs, see the operator and fleet router Pods Running and Ready under the
chart's own security context, start agents on the host, get a ModelDeployment Ready through the
in-cluster operator, serve completions through the in-cluster router, ``helm upgrade`` under load
through the router with 0 failed requests, and ``helm uninstall``.

It needs Linux and root (CI runs it on a fresh machine of this kind). A prerequisite that cannot
be provisioned FAILS the test with one readable line; it is never skipped.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mlx_fleet.devcluster.chart import wait_pod
from mlx_fleet.devcluster.controlplane import apiserver_access_args
from mlx_fleet.devcluster.nodeconfig import (
    NodeSpec,
    cni_conflist,
    containerd_config,
    kubelet_config,
    node_ready,
    sysctls_to_restore,
    tables_to_flush,
)
from mlx_fleet.source_policy import DEV_POLICY

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "mlx-fleet"

# ---- pure decisions ------------------------------------------------------------------------

CONTAINERD_DEFAULT_EXCERPT = """\
version = 2
root = "/var/lib/containerd"
[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    disable_apparmor = false
    restrict_oom_score_adj = false
    sandbox_image = "registry.k8s.io/pause:3.6"
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "/opt/cni/bin"
      conf_dir = "/etc/cni/net.d"
"""


def test_containerd_config_sets_what_these_machines_need() -> None:
    out = containerd_config(CONTAINERD_DEFAULT_EXCERPT, pause_ref="localhost/p:1",
                            cni_bin_dir=Path("/usr/lib/cni"), cni_conf_dir=Path("/w/cni"))
    assert "    restrict_oom_score_adj = true\n" in out
    assert "    disable_apparmor = true\n" in out
    assert '    sandbox_image = "localhost/p:1"\n' in out
    assert '      bin_dir = "/usr/lib/cni"\n' in out and '      conf_dir = "/w/cni"\n' in out
    assert 'root = "/var/lib/containerd"' in out  # the rest untouched (root is a flag)


def test_containerd_config_refuses_defaults_of_another_shape() -> None:
    with pytest.raises(ValueError, match="restrict_oom_score_adj"):
        containerd_config(CONTAINERD_DEFAULT_EXCERPT.replace("restrict_oom_score_adj", "x"),
                          pause_ref="p", cni_bin_dir=Path("/b"), cni_conf_dir=Path("/c"))


def test_cni_config_is_one_bridge_without_nat() -> None:
    spec = NodeSpec(pod_cidr="203.0.113.0/25", cni_bridge="br-x")
    bridge, loopback = cni_conflist(spec)["plugins"]
    assert (bridge["type"], bridge["bridge"], bridge["ipMasq"]) == ("bridge", "br-x", False)
    assert bridge["ipam"]["ranges"] == [[{"subnet": "203.0.113.0/25"}]]
    assert loopback == {"type": "loopback"}


def test_kubelet_config_for_cgroup_v1_without_systemd_on_the_node_address() -> None:
    cfg = kubelet_config(NodeSpec(address="198.51.100.7"), port=1, healthz_port=2,
                         runtime_endpoint="unix:///s.sock", pod_logs_dir=Path("/l"))
    assert (cfg["cgroupDriver"], cfg["failCgroupV1"], cfg["failSwapOn"]) == ("cgroupfs", False, False)
    assert (cfg["address"], cfg["port"], cfg["readOnlyPort"]) == ("198.51.100.7", 1, 0)
    assert (cfg["healthzBindAddress"], cfg["healthzPort"]) == ("127.0.0.1", 2)
    assert cfg["containerRuntimeEndpoint"] == "unix:///s.sock"


@pytest.mark.parametrize(("before", "after", "restore"), [
    ({"kernel.panic": "1"}, {"kernel.panic": "10"}, {"kernel.panic": "1"}),
    ({"kernel.panic": "1"}, {"kernel.panic": "1"}, {}),
    ({"a": "0", "b": "0"}, {"a": "1"}, {"a": "0"}),
    ({}, {"a": "1"}, {}),
], ids=["changed", "unchanged", "gone-after", "new-key"])
def test_sysctls_to_restore(before: dict, after: dict, restore: dict) -> None:
    assert sysctls_to_restore(before, after) == restore


@pytest.mark.parametrize(("saved", "flush"), [
    ("", ["filter", "nat", "mangle", "raw"]),
    ("# Generated\n*filter\n:INPUT ACCEPT [0:0]\nCOMMIT\n*nat\nCOMMIT\n", ["mangle", "raw"]),
], ids=["nothing-loaded", "filter-and-nat-saved"])
def test_tables_absent_before_the_node_are_flushed(saved: str, flush: list[str]) -> None:
    assert tables_to_flush(saved) == flush


@pytest.mark.parametrize(("node", "ready"), [
    ({"status": {"conditions": [{"type": "Ready", "status": "True"}]}}, True),
    ({"status": {"conditions": [{"type": "Ready", "status": "False"}]}}, False),
    ({"status": {"conditions": [{"type": "MemoryPressure", "status": "True"}]}}, False),
    ({}, False),
])
def test_node_ready(node: dict, ready: bool) -> None:
    assert node_ready(node) is ready


def test_api_server_access_flags_change_only_with_a_node() -> None:
    assert apiserver_access_args("") == ["--authorization-mode=RBAC",
                                         "--disable-admission-plugins=ServiceAccount"]
    with_node = apiserver_access_args("n")
    assert "--authorization-mode=Node,RBAC" in with_node
    assert not any("ServiceAccount" in a for a in with_node)


# ---- end to end on a real node -------------------------------------------------------------

@dataclass
class Timings:
    """Wall-clock seconds of each step, printed at the end (docs/development.md quotes them)."""

    steps: dict[str, float] = field(default_factory=dict)

    def record(self, what: str, seconds: float) -> None:
        self.steps[what] = round(seconds, 1)


def _fail(step: str, error: BaseException) -> None:
    """Fail (never skip) with one line: the step, the error's first line and, when the error
    carries a log tail, its last line."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    detail = lines[0] if len(lines) == 1 else f"{lines[0]} … {lines[-1].strip()}"
    pytest.fail(f"real node: {step}: {detail}", pytrace=False)


@dataclass
class RealCluster:
    cp: object
    node: object
    helm: Path
    timings: Timings
    namespace: str


@pytest.fixture(scope="module")
def real_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    """A control plane prepared for a node, the operator image built and imported, and the node
    Ready. Tears everything down after the module."""
    from mlx_fleet.devcluster.binaries import ensure_all
    from mlx_fleet.devcluster.controlplane import start_control_plane
    from mlx_fleet.devcluster.helm import ensure_helm
    from mlx_fleet.devcluster.images import OPERATOR_REF, build_operator_image
    from mlx_fleet.devcluster.node import claim_host, start_node
    from mlx_fleet.devcluster.nodeconfig import NodeSpec

    timings = Timings()
    try:
        binaries, helm = ensure_all(), ensure_helm()
    except Exception as e:  # noqa: BLE001 - one readable line, never a skip
        _fail("building the control plane binaries", e)
    try:
        node = claim_host(NodeSpec(), step=timings.record)
    except Exception as e:  # noqa: BLE001
        _fail("preparing the host", e)
    started = time.monotonic()
    try:
        # The chart installs the CRDs (its crds/ directory), so the control plane does not.
        cp = start_control_plane(tmp_path_factory.mktemp("real-node"), binaries=binaries,
                                 install_crds=False, node_name=node.spec.name,
                                 node_address=node.spec.address)
    except Exception as e:  # noqa: BLE001
        node.stop()
        _fail("starting the control plane", e)
    timings.record("control plane", time.monotonic() - started)
    try:
        started = time.monotonic()
        build_operator_image(REPO)
        timings.record("operator image build (buildah, incl. base when missing)", time.monotonic() - started)
        start_node(cp, node, images=[OPERATOR_REF], step=timings.record)
    except Exception as e:  # noqa: BLE001
        node.stop()
        cp.stop()
        _fail("provisioning the node", e)
    ns = f"rn-{uuid.uuid4().hex[:6]}"
    try:
        yield RealCluster(cp=cp, node=node, helm=helm, timings=timings, namespace=ns)
    finally:
        print("\nreal-node timings (s):", json.dumps(timings.steps, indent=1))
        if node.kube_proxy_error:
            print("kube-proxy:", node.kube_proxy_error)
        node.stop()
        cp.stop()


def _helm(rc: RealCluster, *args: str, timeout: float = 300) -> str:
    env = {**os.environ, **{f"HELM_{k}_HOME": str(rc.cp.workdir / "helm" / k.lower())
                            for k in ("CACHE", "CONFIG", "DATA")}}
    proc = subprocess.run([str(rc.helm), *args, "--namespace", rc.namespace, "--kubeconfig",
                           str(rc.cp.kubeconfig)], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, f"helm {args[0]}: {proc.stdout}{proc.stderr}"
    return proc.stdout


def _json(rc: RealCluster, *args: str) -> dict:
    return json.loads(rc.cp.kubectl(*args, "-n", rc.namespace, "-o", "json").stdout)


def _pods(rc: RealCluster, component: str) -> list[dict]:
    """The chart's Pods of ``component`` (``operator`` or ``router``) not being deleted."""
    return [p for p in _json(rc, "get", "pods", "-l", f"app.kubernetes.io/name=mlx-fleet,"
                             f"app.kubernetes.io/component={component}")["items"]
            if not p["metadata"].get("deletionTimestamp")]


def _wait_pod_ready(rc: RealCluster, not_uid: str = "", timeout: float = 180,
                    component: str = "operator") -> dict:
    """The first Pod of ``component`` (other than the Pod ``not_uid``) seen Running and Ready
    (:func:`mlx_fleet.devcluster.chart.wait_pod`, a watch); fails after ``timeout``."""
    return wait_pod(rc.cp, rc.namespace, component=component, not_uid=not_uid, timeout=timeout)


def _container_process(rc: RealCluster, pod: dict) -> dict[str, str]:
    """/proc/<pid>/status of the operator container's main process, found through containerd."""
    cid = pod["status"]["containerStatuses"][0]["containerID"].removeprefix("containerd://")
    out = subprocess.run(["ctr", "--address", str(rc.node.containerd_address), "-n", "k8s.io",
                          "tasks", "ls"], capture_output=True, text=True, check=True).stdout
    (pid,) = [line.split()[1] for line in out.splitlines()[1:] if line.split()[0] == cid]
    status = Path(f"/proc/{pid}/status").read_text()
    return dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)


@pytest.mark.integration
@pytest.mark.timeout(1800)
def test_chart_runs_the_operator_and_router_on_a_real_node(real_cluster: RealCluster, test_model_dir: Path) -> None:
    from mlx_fleet.contract import Keys
    from mlx_fleet.devcluster.fleet import start_agent
    from mlx_fleet.devcluster.processes import free_port
    from mlx_fleet.devcluster.promserver import ScrapeTarget, start_prometheus

    from fleet_helpers import manifest, wait_ready

    from mlx_fleet.devcluster.images import HOST_CA_BUNDLE, OPERATOR_REF, read_image_file

    rc, cp = real_cluster, real_cluster.cp
    # The host's CA bundle (with the intercepting proxy's CA) was trusted by the build only.
    assert read_image_file(OPERATOR_REF, "/etc/ssl/certs/ca-certificates.crt") != HOST_CA_BUNDLE.read_bytes()
    keys = Keys(f"/mlx-fleet-real-node/{uuid.uuid4().hex[:8]}")
    # The router reaches etcd and the agents on the node's loopback: hostNetwork, as the
    # operator. Its port is then the node's, so one node holds one router Pod (the scheduler
    # refuses a second: its host port is taken).
    router_port = free_port()
    router = f"http://127.0.0.1:{router_port}"
    values = ["--set", "image.repository=localhost/mlx-fleet/mlx-fleet-operator", "--set", "image.tag=dev",
              "--set", "image.pullPolicy=Never", "--set", "hostNetwork=true",
              "--set", f"etcd.endpoints={{{cp.etcd_url}}}", "--set", "etcd.tls.secretName=",
              "--set", f"etcd.prefix={keys.root}",
              "--set", f"metrics.port={free_port()}", "--set", f"health.port={free_port()}",
              "--set", f"operator.watchNamespaces={{{rc.namespace}}}",
              "--set", "router.hostNetwork=true", "--set", f"router.port={router_port}",
              "--set", "router.replicaCount=1", "--set", "router.apiKeys.secretName=router-keys",
              # keys over plain http on the node's loopback: the explicit opt-out
              "--set", "router.tls.secretName=", "--set", "insecure.httpListen=true",
              # the dev policy, explicitly: the test model is a local directory on the host
              "--set-json", f"sourcePolicy={DEV_POLICY.to_json()}"]
    # The router's client keys, from a Secret mounted read-only under the chart's security
    # context (uid 65532, fsGroup 65532, mode 0400): one key naming its tenant.
    api_key = uuid.uuid4().hex
    cp.kubectl("create", "namespace", rc.namespace)
    cp.kubectl("create", "secret", "generic", "router-keys", "-n", rc.namespace,
               f"--from-literal=api-keys={api_key} tenant=real-node")
    if rc.node.kube_proxy is None:  # the chart's documented option for a cluster without one
        values += ["--set", "kubernetesAPI.host=127.0.0.1",
                   "--set", f"kubernetesAPI.port={cp.apiserver_url.rsplit(':', 1)[1]}"]

    # helm install, CRDs included; the operator Pod Running and Ready.
    started = time.monotonic()
    _helm(rc, "install", "mlx-fleet", str(CHART), "--create-namespace", *values)
    pod = _wait_pod_ready(rc)
    rc.timings.record("helm install → operator Pod Ready", time.monotonic() - started)
    router_pod = _wait_pod_ready(rc, component="router")
    rc.timings.record("helm install → router Pod Ready", time.monotonic() - started)
    assert [p["metadata"]["uid"] for p in _pods(rc, "operator")] == [pod["metadata"]["uid"]]
    for crd in sorted((CHART / "crds").glob("*.yaml")):  # installed by helm from crds/
        cp.kubectl("wait", "--for=condition=Established", "-f", str(crd), "--timeout=60s")
    # ... under the chart's own security context, as the kernel sees the process.
    for what, p in (("operator", pod), ("router", router_pod)):
        proc = _container_process(rc, p)
        assert proc["Uid"].split()[:2] == ["65532", "65532"] and proc["Gid"].split()[0] == "65532"
        assert int(proc["CapEff"], 16) == 0 and int(proc["CapPrm"], 16) == 0
        assert proc["NoNewPrivs"] == "1"
        assert proc["Seccomp"] == "2"  # filter mode: the RuntimeDefault profile
        # Its memory against the chart's default limit (values.yaml resources: 512Mi).
        rss_mib = int(proc["VmRSS"].split()[0]) / 1024
        print(f"\n{what} Pod RSS after start: {rss_mib:.0f} MiB")
        assert rss_mib < 512
        c = p["spec"]["containers"][0]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert p["spec"]["securityContext"]["runAsNonRoot"] is True
        assert p["spec"]["hostNetwork"] is True
    assert router_pod["spec"]["containers"][0]["command"] == ["mlx-fleet-router"]
    assert router_pod["spec"]["automountServiceAccountToken"] is False
    # The API server reaches the kubelet (kubectl logs), through the node's InternalIP.
    assert cp.kubectl("logs", pod["metadata"]["name"], "-n", rc.namespace).stdout.strip()

    # Agents on the host register in etcd.
    agents = [start_agent(cp, f"mac-{i}", etcd_prefix=keys.root, memory="64Gi", lease_ttl=5)
              for i in range(2)]
    assert set(asyncio.run(_node_names(cp.etcd_url, keys))) == {"mac-0", "mac-1"}

    # A ModelDeployment gets Ready through the in-cluster operator; a completion is served.
    name = "real-node"
    cp.kubectl("apply", "-f", "-", input=manifest(name, rc.namespace, test_model_dir, replicas=2))
    md = wait_ready(cp, rc.namespace, name, timeout=240)
    endpoints = md["status"]["endpoints"]
    assert sorted(endpoints) == sorted(a.url for a in agents)
    # The operator names the chart's router Service as the URL to use (its --router-url).
    assert md["status"]["router"] == {"url": f"http://mlx-fleet-router.{rc.namespace}.svc",
                                      "model": name}
    # Completions through the in-cluster router (its hostNetwork port on the node).
    assert asyncio.run(_wait_routable(router, name, api_key=api_key)) == 2
    assert asyncio.run(_complete(router, name, api_key=api_key)) >= 1
    assert asyncio.run(_status_without_key(router, name)) == 401

    # Prometheus (the dev set-up's) scrapes the in-cluster operator through the chart's metrics
    # Service: its ClusterIP, routed to the Pod by kube-proxy.
    svc = _json(rc, "get", "service", "mlx-fleet-metrics")["spec"]
    # The router's, as a ServiceMonitor does: its Pod's IP and port (an open /metrics answers
    # only Hosts it knows — the Pod's IP, loopback, its Service's names: DNS rebinding).
    router_ip = _json(rc, "get", "pod", router_pod["metadata"]["name"])["status"]["podIP"]
    prom = start_prometheus(cp.workdir / "prometheus",
                            [ScrapeTarget(f"{svc['clusterIP']}:{svc['ports'][0]['port']}"),
                             ScrapeTarget(f"{router_ip}:{router_port}")],
                            interval="1s")
    try:
        prom.wait_for_scrapes(1, timeout=60)
        ready = prom.query(f'mlxfleet_operator_deployment_replicas{{namespace="{rc.namespace}",'
                           f'name="{name}",state="ready"}}')
        assert [s["value"][1] for s in ready] == ["2"], ready
        routed = prom.query(f'sum(mlxfleet_router_requests_total{{model="{name}",code="200",'
                            f'tenant="real-node"}})')
        assert routed and float(routed[0]["value"][1]) >= 1, routed
    finally:
        prom.stop()

    # helm upgrade with a changed value while clients send requests through the router: the
    # operator Pod is replaced, the router's is not (its template is unchanged), no request fails.
    old_uid = pod["metadata"]["uid"]
    started = time.monotonic()
    result = asyncio.run(_under_load([router], name, api_key=api_key, action=lambda: (
        _helm(rc, "upgrade", "mlx-fleet", str(CHART), *values, "--set", "operator.verbose=true"),
        _wait_pod_ready(rc, not_uid=old_uid))))
    rc.timings.record("helm upgrade → new operator Pod Ready", time.monotonic() - started)
    new_pod = result["value"][1]
    assert new_pod["metadata"]["uid"] != old_uid
    assert "--verbose" in new_pod["spec"]["containers"][0]["args"]
    print(f"\nhelm upgrade under load (through the router): {result['ok']} requests, "
          f"{result['failed']} failed")
    assert result["ok"] > 0 and result["failed"] == 0, result["errors"][:3]
    assert [p["metadata"]["uid"] for p in _pods(rc, "router")] == [router_pod["metadata"]["uid"]]
    # The new operator takes over: the deployment stays Ready with both endpoints.
    assert wait_ready(cp, rc.namespace, name)["status"]["readyReplicas"] == 2

    # helm uninstall: the operator goes; CRDs (helm never deletes crds/), the ModelDeployment
    # and the Macs' assignments stay, and the agents keep serving (docs/operator.md).
    _helm(rc, "uninstall", "mlx-fleet", "--wait")
    cp.kubectl("wait", "--for=delete", "pod", "-l", "app.kubernetes.io/name=mlx-fleet", "-n",
               rc.namespace, "--timeout=120s", timeout=130)
    assert _json(rc, "get", "pods", "-l", "app.kubernetes.io/name=mlx-fleet")["items"] == []
    assert _json(rc, "get", "deployments")["items"] == []
    assert "mlx-fleet.io/finalizer" in _json(rc, "get", "modeldeployment", name)["metadata"]["finalizers"]
    assignments = asyncio.run(_keys(cp.etcd_url, keys.assignments_prefix))
    assert len(assignments) == 2 and set(asyncio.run(_node_names(cp.etcd_url, keys))) == {"mac-0", "mac-1"}
    assert asyncio.run(_complete(endpoints[1], name)) >= 1
    for agent in agents:
        agent.process.stop()


async def _node_names(etcd_url: str, keys) -> list[str]:
    from mlx_fleet.store import EtcdStore

    async with EtcdStore(etcd_url) as store:
        listing = await store.list(keys.nodes_prefix)
        return [kv.key.removeprefix(keys.nodes_prefix) for kv in listing.items]


async def _keys(etcd_url: str, prefix: str) -> list[str]:
    from mlx_fleet.store import EtcdStore

    async with EtcdStore(etcd_url) as store:
        return [kv.key for kv in (await store.list(prefix)).items]


async def _wait_routable(router: str, model: str, *, api_key: str,
                         timeout: float = 60) -> int:
    """The router's Ready replica count for ``model`` (``GET /v1/models``) once it is 2 (the
    router follows etcd: the table may trail the operator's status by a watch event); the last
    count seen after ``timeout`` seconds otherwise. Polls: the router has no watch API."""
    import aiohttp

    deadline, count = time.monotonic() + timeout, 0
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            async with http.get(f"{router}/v1/models",  # behind the key, like /v1/*
                                headers={"Authorization": f"Bearer {api_key}"}) as r:
                models = {m["id"]: m for m in (await r.json())["data"]}
            count = models.get(model, {}).get("ready_replicas", 0)
            if count == 2:
                break
            await asyncio.sleep(0.2)
    return count


async def _status_without_key(endpoint: str, model: str) -> int:
    import aiohttp

    async with aiohttp.ClientSession() as http, http.post(
            f"{endpoint}/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2}) as r:
        return r.status


async def _complete(endpoint: str, model: str, api_key: str = "unused") -> int:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{endpoint}/v1", api_key=api_key)
    try:
        done = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=4)
        return done.usage.completion_tokens
    finally:
        await client.close()


async def _under_load(endpoints: list[str], model: str, action, api_key: str = "") -> dict:
    """Run the blocking ``action`` in a thread while 4 clients send completions round-robin
    over ``endpoints`` (with ``api_key`` as a bearer token when given); returns
    ``{"value", "ok", "failed", "errors"}``."""
    import aiohttp

    stop = asyncio.Event()
    counts = {"ok": 0, "failed": 0, "errors": []}

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def client(i: int) -> None:
        async with aiohttp.ClientSession(headers=headers) as http:
            n = i
            while not stop.is_set():
                url = f"{endpoints[n % len(endpoints)]}/v1/completions"
                n += 1
                try:
                    async with http.post(url, json={"model": model, "prompt": "hi", "max_tokens": 2},
                                         timeout=aiohttp.ClientTimeout(total=30)) as r:
                        await r.read()
                        if r.status == 200:
                            counts["ok"] += 1
                        else:
                            counts["failed"] += 1
                            counts["errors"].append(f"{url}: HTTP {r.status}")
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    counts["failed"] += 1
                    counts["errors"].append(f"{url}: {e!r}")

    tasks = [asyncio.create_task(client(i)) for i in range(4)]
    try:
        value = await asyncio.to_thread(action)
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    return {"value": value, **counts}
