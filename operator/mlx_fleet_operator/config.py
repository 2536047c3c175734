"""The operator's configuration: what :func:`~.main.main` reads from its command line (or the
environment, when the handlers are loaded by ``kopf run``) and hands to the start-up handler
in kopf's operator ``memo`` (``memo.config``). Plain data."""

from __future__ import annotations

import dataclasses
import fnmatch
import os

from mlx_fleet.contract import ROOT
from mlx_fleet.etcd_credentials import EtcdCredentials
from mlx_fleet.source_policy import DEFAULT_POLICY, SourcePolicy
from mlx_fleet.source_policy_file import ENV_SOURCE_POLICY, load_policy

from .reconcile import DEFAULT_WRITER

def listed_namespaces(namespaces: tuple[str, ...]) -> tuple[str, ...] | None:
    """The namespaces to list one by one (``--namespace`` values that are all exact names), or
    None: list cluster-wide (no ``--namespace``, or a glob pattern among them; the caller
    filters by scope). With exact names the chart grants the namespaced resources only there
    (a Role per namespace), so a cluster-wide listing would be refused."""
    exact = bool(namespaces) and not any(set(p) & set("*?[]!,") for p in namespaces)
    return namespaces if exact else None


#: Default seconds between garbage collections of orphaned assignments (``--gc-interval``;
#: see :func:`.orphan_gc.collect_orphans`).
GC_SECONDS = 60.0


@dataclasses.dataclass(frozen=True)
class PeeringConfig:
    """kopf peering of this replica (``--peering``): the peering object's ``name``, this
    replica's ``identity`` and ``priority`` as given to kopf, and whether the operator is
    cluster-wide (one ClusterKopfPeering) or namespaced (a KopfPeering per watched namespace)."""

    name: str
    identity: str
    priority: int
    clusterwide: bool


@dataclasses.dataclass
class OperatorConfig:
    """The operator's configuration, set by :func:`mlx_fleet_operator.main.main` (or read from the
    environment when the module is loaded by ``kopf run``)."""

    etcd_endpoint: str = "http://127.0.0.1:2379"
    etcd_prefix: str = ROOT
    etcd_credentials: EtcdCredentials | None = None  # TLS / auth (docs/security.md)
    metrics_port: int = 8080  # 0 = do not serve metrics
    writer: str = DEFAULT_WRITER
    namespaces: tuple[str, ...] = ()  # watched namespaces (globs); empty = cluster-wide
    gc_interval: float = GC_SECONDS  # seconds between orphan collections
    peering: PeeringConfig | None = None  # None: standalone
    #: The fleet router's base URL shown in each ``status.router`` (None: no router).
    router_url: str | None = None
    #: Whether ``/metrics`` is already served on ``metrics_port`` (main()'s pre-flight check
    #: binds it); else the start-up handler serves it.
    metrics_served: bool = False
    #: Which model sources ModelDeployments and Canaries may name (``--source-policy``;
    #: :mod:`.admission`); the same record as every agent's. Default: the secure policy.
    source_policy: SourcePolicy = DEFAULT_POLICY

    def in_scope(self, namespace: str) -> bool:
        """Whether this operator watches ``namespace`` (garbage collection stays inside)."""
        return not self.namespaces or any(fnmatch.fnmatchcase(namespace, p)
                                          for p in self.namespaces)

    @classmethod
    def from_env(cls) -> OperatorConfig:
        return cls(etcd_endpoint=os.environ.get("MLX_FLEET_ETCD_ENDPOINT", cls.etcd_endpoint),
                   etcd_prefix=os.environ.get("MLX_FLEET_ETCD_PREFIX", ROOT),
                   metrics_port=int(os.environ.get("MLX_FLEET_METRICS_PORT", "8080")),
                   router_url=os.environ.get("MLX_FLEET_ROUTER_URL", "").rstrip("/") or None,
                   source_policy=load_policy(os.environ.get(ENV_SOURCE_POLICY)))

