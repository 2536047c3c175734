"""Start the operator, node agents and the fleet router as real processes against a
:class:`ControlPlane`.

Used by the demo, the end-to-end tests and the benchmarks, so all three run the very same
command lines a user would (``python -m mlx_fleet_operator``, ``python -m node_agent``,
``python -m mlx_fleet_router``).

The operator and the agents get ``--source-policy`` explicitly: by default
:data:`~mlx_fleet.source_policy.DEV_POLICY` (models from loopback servers and from local
directories anywhere, which a dev cluster on one machine uses; the secure default refuses
both), or the ``source_policy`` a caller gives (None: the flag is left out, so the process
runs under the secure default).
"""

from __future__ import annotations

import json
import sys
import urllib.request
from dataclasses import dataclass

from mlx_fleet.contract import ROOT
from mlx_fleet.devcluster.controlplane import ControlPlane
from mlx_fleet.devcluster.processes import ManagedProcess, free_port
from mlx_fleet.source_policy import DEV_POLICY, SourcePolicy


def policy_args(policy: SourcePolicy | None) -> tuple[str, ...]:
    """``("--source-policy", <the record as JSON>)``, or nothing for None."""
    return () if policy is None else ("--source-policy", policy.to_json())


@dataclass
class AgentProcess:
    """A node agent process and the URL its OpenAI-compatible API listens on."""

    name: str
    url: str
    process: ManagedProcess

    def health(self) -> tuple[int, dict]:
        """``GET /health`` → (HTTP status, body); raises ``OSError`` if unreachable."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=3) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:  # 503 carries a body too
            return e.code, json.load(e)


def start_operator(cp: ControlPlane, *, etcd_prefix: str = ROOT, timeout: float = 120.0,
                   extra_args: tuple[str, ...] = (),
                   env: dict[str, str] | None = None,
                   metrics_port: int | None = None,
                   etcd_url: str | None = None, log_name: str = "operator",
                   source_policy: SourcePolicy | None = DEV_POLICY) -> ManagedProcess:
    """Run ``python -m mlx_fleet_operator`` against ``cp``; returns once its liveness probe
    answers (kopf is connected to the API server and its handlers are registered). ``env`` is
    merged over ``cp.env()`` (e.g. a ``KUBECONFIG`` with a ServiceAccount's token).
    ``metrics_port``: where it serves ``/metrics`` (default: a free port). ``etcd_url``: the
    assignments store (default ``cp.etcd_url``; the fault suite gives one it may stop).
    ``log_name``: its log is ``cp.logs_dir / f"{log_name}.log"`` (give each of several
    replicas its own). ``source_policy``: its ``--source-policy`` (module docstring)."""
    metrics, liveness = metrics_port or free_port(), free_port()
    proc = ManagedProcess("operator", [
        sys.executable, "-m", "mlx_fleet_operator",
        "--etcd-endpoint", etcd_url or cp.etcd_url, "--etcd-prefix", etcd_prefix,
        "--metrics-port", str(metrics), "--liveness-port", str(liveness),
        *policy_args(source_policy), *extra_args,
    ], cp.logs_dir / f"{log_name}.log", env={**cp.env(), "PYTHONUNBUFFERED": "1", **(env or {})})
    cp.extra.append(proc)

    def live() -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{liveness}/healthz", timeout=2) as r:
            return r.status == 200

    proc.wait_until(live, timeout=timeout, what="live (/healthz)")
    return proc


def start_agent(cp: ControlPlane, name: str, *, etcd_prefix: str = ROOT,
                chip: str = "Apple M3 Max", memory: str = "64Gi", labels: dict[str, str] | None = None,
                lease_ttl: int = 5, timeout: float = 120.0,
                extra_args: tuple[str, ...] = (), etcd_url: str | None = None,
                env: dict[str, str] | None = None,
                source_policy: SourcePolicy | None = DEV_POLICY) -> AgentProcess:
    """Run ``python -m node_agent`` as node ``name`` (simulated ``chip``/``memory`` on Linux);
    returns once ``/health`` answers 200 (HTTP up and node registered under its lease).
    ``etcd_url``: the etcd it talks to (default ``cp.etcd_url``; the fault suite puts a proxy
    or an etcd of its own there). ``env`` is merged over ``cp.env()`` (e.g. ``MLX_FLEET_CACHE``
    for its download directory, ``SSL_CERT_FILE`` to trust a test mirror). A process started
    again with the same ``name`` appends to the same log. ``source_policy``: its
    ``--source-policy`` (module docstring)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    label_args = [a for k, v in (labels or {}).items() for a in ("--label", f"{k}={v}")]
    proc = ManagedProcess(f"agent {name}", [
        sys.executable, "-m", "node_agent",
        "--node-name", name, "--etcd-endpoint", etcd_url or cp.etcd_url, "--etcd-prefix", etcd_prefix,
        "--listen", f"127.0.0.1:{port}", "--advertise-url", url,
        "--simulated-chip", chip, "--simulated-memory", memory,
        "--lease-ttl", str(lease_ttl), *label_args, *policy_args(source_policy), *extra_args,
    ], cp.logs_dir / f"agent-{name}.log", env={**cp.env(), "PYTHONUNBUFFERED": "1", **(env or {})})
    cp.extra.append(proc)
    agent = AgentProcess(name=name, url=url, process=proc)
    proc.wait_until(lambda: agent.health()[0] == 200, timeout=timeout, what="healthy (/health)")
    return agent


@dataclass
class RouterProcess:
    """A fleet router process (``python -m mlx_fleet_router``) and the URL it serves on."""

    url: str
    process: ManagedProcess


def start_router(cp: ControlPlane, *, etcd_prefix: str = ROOT,
                 namespaces: tuple[str, ...] = (), port: int | None = None,
                 timeout: float = 60.0, extra_args: tuple[str, ...] = (),
                 etcd_url: str | None = None, env: dict[str, str] | None = None,
                 log_name: str = "router") -> RouterProcess:
    """Run ``python -m mlx_fleet_router`` against ``cp``'s etcd (``etcd_url`` overrides it),
    serving the ModelDeployments of ``namespaces`` (all when empty) on 127.0.0.1:``port`` (a
    free port by default); returns once its ``/health`` answers 200 (it follows etcd). ``env``
    is merged over ``cp.env()``; the log is ``cp.logs_dir / f"{log_name}.log"``."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    scope = [a for ns in namespaces for a in ("--namespace", ns)]
    proc = ManagedProcess("router", [
        sys.executable, "-m", "mlx_fleet_router",
        "--etcd-endpoint", etcd_url or cp.etcd_url, "--etcd-prefix", etcd_prefix,
        "--listen", "127.0.0.1", "--port", str(port), *scope, *extra_args,
    ], cp.logs_dir / f"{log_name}.log", env={**cp.env(), "PYTHONUNBUFFERED": "1", **(env or {})})
    cp.extra.append(proc)

    def healthy() -> bool:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200

    proc.wait_until(healthy, timeout=timeout, what="healthy (/health)")
    return RouterProcess(url=url, process=proc)
