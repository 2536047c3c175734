"""The local node's settings as plain data: pure functions of :class:`NodeSpec` and inputs that
:mod:`mlx_fleet.devcluster.node` gathers (``containerd config default``, sysctl values, a Node
object). Table-tested in tests/test_real_node.py. Why each setting is there: docs/development.md,
"A real node".
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class NodeSpec:
    """Where the node lives on the host.

    ``address``: a /32 from TEST-NET-2 (RFC 5737, never routed) on ``link``, a bridge with no
    ports: the kubelet refuses a loopback node IP, and an iptables rule drops anything to it
    that does not come from this host. ``pod_cidr``: the CNI bridge's range (only Pods without
    hostNetwork use it), a documentation range (RFC 5737 TEST-NET-3) like the node address, so
    nothing on the host's own networks is shadowed.
    """

    name: str = "mlx-fleet-node"
    address: str = "198.51.100.10"
    link: str = "mlxfleet0"
    cni_bridge: str = "mlxfleet-cni0"
    pod_cidr: str = "203.0.113.0/24"


def containerd_config(default: str, *, pause_ref: str, cni_bin_dir: Path, cni_conf_dir: Path) -> str:
    """``containerd config default`` output with the settings these machines need.

    ``restrict_oom_score_adj``: lowering ``oom_score_adj`` needs CAP_SYS_RESOURCE, which the VM
    withholds (every sandbox otherwise fails "can't get final child's PID from pipe");
    ``disable_apparmor``: no AppArmor here; ``sandbox_image``: the locally built pause;
    CNI dirs: Debian's plugins and a private config dir. Raises ``ValueError`` if a setting is
    not found exactly once (a containerd whose defaults changed shape).
    """
    edits = [
        (r"^(\s*)restrict_oom_score_adj = \w+$", r"\1restrict_oom_score_adj = true"),
        (r"^(\s*)disable_apparmor = \w+$", r"\1disable_apparmor = true"),
        (r'^(\s*)sandbox_image = ".*"$', rf'\1sandbox_image = "{pause_ref}"'),
        (r'^(\s*)bin_dir = "/opt/cni/bin"$', rf'\1bin_dir = "{cni_bin_dir}"'),
        (r'^(\s*)conf_dir = "/etc/cni/net.d"$', rf'\1conf_dir = "{cni_conf_dir}"'),
    ]
    out = default
    for pattern, repl in edits:
        out, n = re.subn(pattern, repl, out, flags=re.M)
        if n != 1:
            raise ValueError(f"containerd default config: {pattern!r} matched {n} times, not once")
    return out


def cni_conflist(spec: NodeSpec) -> dict:
    """One ``bridge`` + ``host-local`` network: the kubelet reports NotReady without a CNI
    config even when every Pod uses hostNetwork. No masquerade (no NAT rules to clean up)."""
    return {
        "cniVersion": "0.4.0", "name": "mlx-fleet",
        "plugins": [
            {"type": "bridge", "bridge": spec.cni_bridge, "isGateway": True, "ipMasq": False,
             "hairpinMode": True,
             "ipam": {"type": "host-local", "ranges": [[{"subnet": spec.pod_cidr}]],
                      "routes": [{"dst": "0.0.0.0/0"}]}},
            {"type": "loopback"},
        ],
    }


def kubelet_config(spec: NodeSpec, *, port: int, healthz_port: int, runtime_endpoint: str,
                   pod_logs_dir: Path) -> dict:
    """The KubeletConfiguration (kubelet.config.k8s.io/v1beta1) for this host.

    cgroup v1 with no systemd: ``cgroupDriver: cgroupfs``, ``failCgroupV1: false`` (the default
    flips in 1.35); ``failSwapOn: false``. The API port listens on the node address only (local
    traffic, see :class:`NodeSpec`) with anonymous access, so that the API server (which has no
    kubelet client certificate here) can fetch logs; the read-only port is off. No cluster DNS:
    the chart's Pods use the host's resolver (hostNetwork) and etcd by address.
    """
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "address": spec.address, "port": port, "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1", "healthzPort": healthz_port,
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "cgroupDriver": "cgroupfs", "failSwapOn": False, "failCgroupV1": False,
        "containerRuntimeEndpoint": runtime_endpoint,
        "podLogsDir": str(pod_logs_dir),
        "clusterDomain": "cluster.local", "resolvConf": "/etc/resolv.conf",
        "registerNode": True, "serializeImagePulls": False,
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%",
                         "imagefs.available": "1%"},
    }


def sysctls_to_restore(before: Mapping[str, str], after: Mapping[str, str]) -> dict[str, str]:
    """The ``before`` values of the sysctls that differ in ``after`` (those present in both)."""
    return {k: v for k, v in before.items() if k in after and after[k] != v}


def node_ready(node: Mapping) -> bool:
    """Whether a Node object (as JSON) has condition ``Ready`` = ``"True"``."""
    conds = node.get("status", {}).get("conditions", [])
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


#: The iptables tables the kubelet and kube-proxy write to.
IPTABLES_TABLES = ("filter", "nat", "mangle", "raw")


def tables_to_flush(saved: str) -> list[str]:
    """The :data:`IPTABLES_TABLES` absent from ``saved`` (``iptables-save`` output taken before
    the node started): restoring ``saved`` leaves those alone, so they are flushed instead."""
    had = set(re.findall(r"^\*(\w+)$", saved, re.M))
    return [t for t in IPTABLES_TABLES if t not in had]
