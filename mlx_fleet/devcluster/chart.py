"""The chart (``charts/mlx-fleet``) on the local real node: the node started with the operator
image built and imported, ``helm`` run with a private home, the values a local install needs, and
the operator Pod watched until it is Running and Ready.

One copy for ``mlx-fleet demo --node``, ``mlx-fleet dev up --node`` and
``tests/test_real_node.py`` (issue 18 §3).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

from mlx_fleet.devcluster.binaries import ProgressFn
from mlx_fleet.devcluster.controlplane import REPO_ROOT, ControlPlane
from mlx_fleet.devcluster.node import Node, StepFn, start_node
from mlx_fleet.source_policy import DEV_POLICY

#: The chart, in this repository.
CHART = REPO_ROOT / "charts" / "mlx-fleet"
#: The labels selecting the chart's Pods of one component (``operator`` or ``router``): its
#: templates' ``app.kubernetes.io/name`` and ``app.kubernetes.io/component``.
def component_selector(component: str) -> str:
    return f"app.kubernetes.io/name=mlx-fleet,app.kubernetes.io/component={component}"


class HelmFailed(RuntimeError):
    """A ``helm`` command exited non-zero; the message holds its output."""


def start_chart_node(cp: ControlPlane, node: Node, *, step: StepFn | None = None,
                     progress: ProgressFn | None = None) -> None:
    """Build the operator image from this repository's ``Dockerfile`` (buildah; the Debian base
    on first use), then start ``node`` (claimed by :func:`~mlx_fleet.devcluster.node.claim_host`)
    with that image imported into its containerd; returns once the Node is Ready. ``step(what,
    seconds)`` is told each step's wall-clock time. Raises what
    :func:`~mlx_fleet.devcluster.images.build_operator_image` and
    :func:`~mlx_fleet.devcluster.node.start_node` raise."""
    from mlx_fleet.devcluster.images import OPERATOR_REF, build_operator_image

    started = time.monotonic()
    build_operator_image(REPO_ROOT)
    if step is not None:
        step(f"operator image {OPERATOR_REF} (buildah)", time.monotonic() - started)
    start_node(cp, node, images=[OPERATOR_REF], step=step, progress=progress)


def local_values(cp: ControlPlane, node: Node, *, namespace: str, etcd_prefix: str,
                 metrics_port: int, health_port: int, router_port: int) -> list[str]:
    """``helm --set`` arguments for the chart on the local node: the locally built image
    (never pulled), host networking (the agents and etcd listen on the host's loopback), the
    dev etcd under ``etcd_prefix`` (plain http on loopback: no TLS Secret), host ports ``metrics_port``/``health_port`` (free ones: the
    Pod shares the host's ports), one watched ``namespace``, the chart's fleet router on the
    host's network too (one Pod: its port ``router_port`` is the node's; no API keys, with the
    chart's explicit ``insecure.listenWithoutKeys``), the dev source policy
    (:data:`~mlx_fleet.source_policy.DEV_POLICY`), and — where kube-proxy does not run
    on the node (``node.kube_proxy is None``) — the chart's documented direct API server
    address."""
    from mlx_fleet.devcluster.images import OPERATOR_REF

    repository, tag = OPERATOR_REF.rsplit(":", 1)
    values = ["--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
              "--set", "image.pullPolicy=Never", "--set", "hostNetwork=true",
              # the dev etcd: plain http on the host's loopback (no TLS Secret; the chart
              # accepts plain http to loopback without insecure.etcdHttp)
              "--set", f"etcd.endpoints={{{cp.etcd_url}}}", "--set", "etcd.tls.secretName=",
              "--set", f"etcd.prefix={etcd_prefix}",
              "--set", f"metrics.port={metrics_port}", "--set", f"health.port={health_port}",
              "--set", f"operator.watchNamespaces={{{namespace}}}",
              "--set", "router.hostNetwork=true", "--set", f"router.port={router_port}",
              "--set", "router.replicaCount=1",
              # no API keys on this development node: the explicit opt-out (the router then
              # answers only loopback Host names and its Service's)
              "--set", "router.apiKeys.secretName=", "--set", "insecure.listenWithoutKeys=true",
              "--set", "router.tls.secretName=",  # no keys to protect: plain http on loopback
              # the URL clients on this host use (the operator shows it in status.router): the
              # chart's default, the router Service's cluster DNS name, has no DNS here
              "--set", f"router.url=http://127.0.0.1:{router_port}",
              # models from local directories and loopback servers, said explicitly (the
              # chart's default source policy refuses both): the agents get the same record
              "--set-json", f"sourcePolicy={DEV_POLICY.to_json()}"]
    if node.kube_proxy is None:
        values += ["--set", "kubernetesAPI.host=127.0.0.1",
                   "--set", f"kubernetesAPI.port={cp.apiserver_url.rsplit(':', 1)[1]}"]
    return values


def helm(cp: ControlPlane, helm_exe: Path, namespace: str, *args: str, timeout: float = 300) -> str:
    """Run ``helm ARGS --namespace NAMESPACE --kubeconfig <cp's>`` from the repository root, with
    helm's cache/config/data under ``cp.workdir/helm`` (never the user's); returns its stdout.
    Raises :class:`HelmFailed` with the output on a non-zero exit, ``subprocess.TimeoutExpired``
    after ``timeout`` seconds."""
    env = {**os.environ, **{f"HELM_{k}_HOME": str(cp.workdir / "helm" / k.lower())
                            for k in ("CACHE", "CONFIG", "DATA")}}
    proc = subprocess.run([str(helm_exe), *args, "--namespace", namespace, "--kubeconfig",
                           str(cp.kubeconfig)], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=REPO_ROOT)
    if proc.returncode != 0:
        raise HelmFailed(f"helm {args[0]}: {proc.stdout}{proc.stderr}".strip())
    return proc.stdout


def pod_running_ready(pod: dict, *, not_uid: str = "") -> bool:
    """Whether ``pod`` (a Pod object) is Running with condition Ready=True, not being deleted,
    and is not the Pod whose ``metadata.uid`` is ``not_uid``."""
    meta, status = pod.get("metadata", {}), pod.get("status", {})
    ready = {c.get("type"): c.get("status") for c in status.get("conditions", [])}.get("Ready")
    return (meta.get("uid") != not_uid and not meta.get("deletionTimestamp")
            and status.get("phase") == "Running" and ready == "True")


def wait_pod(cp: ControlPlane, namespace: str, *, component: str = "operator",
             not_uid: str = "", timeout: float = 180) -> dict:
    """The first Pod of the chart's ``component`` (:func:`component_selector`; other than the
    Pod ``not_uid``) seen Running and Ready, through a watch (``kubectl get -w``: the current
    Pods, then every change). Raises ``TimeoutError`` after ``timeout`` seconds, naming the last
    Pod seen."""
    proc = subprocess.Popen(
        [str(cp.binaries.kubectl), "--kubeconfig", str(cp.kubeconfig), "get", "pods", "-l",
         component_selector(component), "-n", namespace, "-w", "-o", "json",
         "--output-watch-events"],
        stdout=subprocess.PIPE, text=True)
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    last: dict = {}
    try:
        assert proc.stdout is not None
        decoder, buf = json.JSONDecoder(), ""
        for line in proc.stdout:
            buf += line
            try:
                event, end = decoder.raw_decode(buf.lstrip())
            except json.JSONDecodeError:
                continue  # an object spans several lines: read on
            buf = buf.lstrip()[end:]
            last = event["object"]
            if event["type"] != "DELETED" and pod_running_ready(last, not_uid=not_uid):
                return last
    finally:
        timer.cancel()
        proc.kill()
        proc.wait()
    raise TimeoutError(f"no new {component} Pod Running and Ready after {timeout:.0f}s; last seen: "
                       f"{last.get('metadata', {}).get('name')} {last.get('status')}")
