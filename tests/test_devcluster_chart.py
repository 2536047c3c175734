"""The pure parts of :mod:`mlx_fleet.devcluster.chart` (the chart on the local real node)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mlx_fleet.devcluster.chart import local_values, pod_running_ready
from mlx_fleet.source_policy import DEV_POLICY


def _pod(uid: str = "u1", phase: str = "Running", ready: str = "True", deleting: bool = False) -> dict:
    meta = {"uid": uid} | ({"deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {})
    return {"metadata": meta, "status": {"phase": phase,
                                         "conditions": [{"type": "PodScheduled", "status": "True"},
                                                        {"type": "Ready", "status": ready}]}}


@pytest.mark.parametrize(("pod", "not_uid", "expected"), [
    (_pod(), "", True),
    (_pod(), "u1", False),
    (_pod(), "u0", True),
    (_pod(phase="Pending"), "", False),
    (_pod(ready="False"), "", False),
    (_pod(deleting=True), "", False),
    ({"metadata": {"uid": "u1"}, "status": {"phase": "Running"}}, "", False),
], ids=["ready", "the-old-pod", "another-pod", "pending", "not-ready", "terminating", "no-conditions"])
def test_pod_running_ready(pod: dict, not_uid: str, expected: bool) -> None:
    assert pod_running_ready(pod, not_uid=not_uid) is expected


def _values(kube_proxy: object) -> dict[str, str]:
    cp = SimpleNamespace(etcd_url="http://127.0.0.1:2379", apiserver_url="https://apiserver.example:6443")
    args = local_values(cp, SimpleNamespace(kube_proxy=kube_proxy), namespace="ns",  # type: ignore[arg-type]
                        etcd_prefix="/p", metrics_port=1, health_port=2, router_port=3)
    assert set(args[::2]) <= {"--set", "--set-json"}
    return dict(a.split("=", 1) for a in args[1::2])


def test_local_values_use_the_local_image_host_network_and_dev_etcd() -> None:
    values = _values(kube_proxy=object())
    assert values == {
        "image.repository": "localhost/mlx-fleet/mlx-fleet-operator", "image.tag": "dev",
        "image.pullPolicy": "Never", "hostNetwork": "true",
        "etcd.endpoints": "{http://127.0.0.1:2379}", "etcd.tls.secretName": "", "etcd.prefix": "/p",
        "metrics.port": "1", "health.port": "2", "operator.watchNamespaces": "{ns}",
        "router.hostNetwork": "true", "router.port": "3", "router.replicaCount": "1",
        "router.url": "http://127.0.0.1:3",
        "router.apiKeys.secretName": "", "insecure.listenWithoutKeys": "true",
        "router.tls.secretName": "",
        "sourcePolicy": DEV_POLICY.to_json()}  # explicitly the dev policy (local models)


def test_local_values_reach_the_api_server_directly_without_kube_proxy() -> None:
    values = _values(kube_proxy=None)
    assert (values["kubernetesAPI.host"], values["kubernetesAPI.port"]) == ("127.0.0.1", "6443")
