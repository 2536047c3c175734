"""The local control plane: etcd and kube-apiserver on loopback, envtest-style.

One :class:`ControlPlane` holds two etcd instances (one for mlx-fleet's assignments, one as
kube-apiserver's storage, so neither can disturb the other), a kube-apiserver with RBAC and a
static admin token, and a kubeconfig for kubectl, kopf and the Kubernetes client. The demo, the
tests and the benchmarks all use it; ``mlx-fleet dev up`` runs it by hand.

Readiness is awaited on the components' own health endpoints (etcd ``/health``, apiserver
``/readyz``), never on fixed sleeps. :meth:`ControlPlane.stop` (also on ``with`` exit) stops
every process and removes the working directory unless asked to keep it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
import os
import secrets
import shutil
import ssl
import subprocess
import tempfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from mlx_fleet.devcluster.binaries import Binaries, ensure_all
from mlx_fleet.devcluster.processes import ManagedProcess, ProcessFailed, free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
CRDS_DIR = REPO_ROOT / "crds"


@dataclass
class EtcdServer:
    """A single-member etcd on 127.0.0.1 with its data in ``data_dir``. ``health_url`` is a
    plain-HTTP ``/health`` (the client URL itself, or for a TLS etcd its metrics listener)."""

    name: str
    process: ManagedProcess
    client_url: str
    data_dir: Path
    health_url: str = ""

    def healthy(self) -> bool:
        with urllib.request.urlopen(f"{self.health_url or self.client_url}/health", timeout=2) as r:
            return json.load(r).get("health") == "true"

    def stop(self) -> None:
        self.process.stop()

    def restart(self, timeout: float = 60.0) -> None:
        """Start etcd again from its data directory with the very same command line (same
        ports, same member), after :meth:`stop` or a kill: the fault suite's "etcd restarted".
        Returns once ``/health`` is healthy; raises :class:`ProcessFailed` (with the log tail)
        if it exits or stays unhealthy, ``RuntimeError`` if it is still running."""
        if self.process.alive():
            raise RuntimeError(f"{self.name} is still running (pid {self.process.pid})")
        self.process = ManagedProcess(self.name, self.process.argv, self.process.log_path)
        self.process.wait_until(self.healthy, timeout=timeout, what="healthy after a restart")


@dataclass(frozen=True)
class EtcdServerTLS:
    """PEM files for a TLS etcd: its server certificate and key, and the CA that signs the
    client certificates it accepts (``--client-cert-auth``: a client must present one)."""

    cert_file: Path
    key_file: Path
    client_ca_file: Path


@dataclass(frozen=True)
class EtcdJwt:
    """etcd's signed auth tokens (``--auth-token jwt,...``) instead of its unsigned "simple"
    ones: the PEM key pair (``mlx-fleet certs jwt-keys``), the ``sign_method`` (``ES256`` for
    a P-256 key, ``RS256`` for RSA) and the tokens' ``ttl`` (etcd's default 5m)."""

    public_key: Path
    private_key: Path
    sign_method: str = "ES256"
    ttl: str = "5m"

    def flag(self) -> list[str]:
        return ["--auth-token", f"jwt,pub-key={self.public_key},priv-key={self.private_key},"
                                f"sign-method={self.sign_method},ttl={self.ttl}"]


def start_etcd(workdir: Path, binaries: Binaries, name: str = "etcd", *,
               timeout: float = 60.0, tls: EtcdServerTLS | None = None,
               jwt: EtcdJwt | None = None, extra_args: Sequence[str] = ()) -> EtcdServer:
    """Start etcd with free loopback ports; returns once ``/health`` reports healthy.

    ``tls``: serve clients over ``https://`` with mutual TLS (``--client-cert-auth``); the
    health check then goes to a plain-HTTP metrics listener. ``jwt``: sign auth tokens
    (:class:`EtcdJwt`; they matter once authentication is enabled). ``extra_args``: more etcd
    flags (e.g. ``--auth-token-ttl``). Raises :class:`ProcessFailed` (with the log tail) if it
    exits or stays unhealthy.
    """
    client, peer = free_port(), free_port()
    data = workdir / name
    url = f"{'https' if tls else 'http'}://127.0.0.1:{client}"
    args: list[str | Path] = [
        binaries.etcd, "--name", name, "--data-dir", data,
        "--listen-client-urls", url, "--advertise-client-urls", url,
        "--listen-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-cluster", f"{name}=http://127.0.0.1:{peer}",
        "--log-level", "warn", "--quota-backend-bytes", str(2 * 1024**3),
    ]
    health = ""
    if tls is not None:
        health = f"http://127.0.0.1:{free_port()}"
        args += ["--cert-file", tls.cert_file, "--key-file", tls.key_file,
                 "--trusted-ca-file", tls.client_ca_file, "--client-cert-auth",
                 "--listen-metrics-urls", health]
    if jwt is not None:
        args += jwt.flag()
    proc = ManagedProcess(name, [*args, *extra_args], workdir / "logs" / f"{name}.log")
    server = EtcdServer(name=name, process=proc, client_url=url, data_dir=data, health_url=health)
    proc.wait_until(server.healthy, timeout=timeout, what="healthy")
    return server


@dataclass
class ControlPlane:
    """A running local control plane. Attribute values are valid until :meth:`stop`."""

    workdir: Path
    binaries: Binaries
    etcd: EtcdServer  # mlx-fleet's assignments store
    kube_etcd: EtcdServer  # kube-apiserver's storage
    apiserver: ManagedProcess
    apiserver_url: str
    kubeconfig: Path
    token: str
    keep_workdir: bool = False
    extra: list[ManagedProcess] = field(default_factory=list)
    #: With a real node (:mod:`mlx_fleet.devcluster.node`): its name and its kubelet's token
    #: (user ``system:node:<name>`` in ``system:nodes``); empty otherwise.
    node_name: str = ""
    node_token: str = ""

    @property
    def etcd_url(self) -> str:
        return self.etcd.client_url

    @property
    def logs_dir(self) -> Path:
        return self.workdir / "logs"

    def env(self) -> dict[str, str]:
        """Environment for child processes that talk to this control plane."""
        return {
            "KUBECONFIG": str(self.kubeconfig),
            "MLX_FLEET_ETCD_ENDPOINT": self.etcd_url,
            "PATH": os.pathsep.join([*map(str, self.binaries.bin_dirs), os.environ.get("PATH", "")]),
        }

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run the cached kubectl against this control plane; output captured as text.
        Raises ``subprocess.CalledProcessError`` (with stderr) when ``check`` and it fails."""
        return subprocess.run([str(self.binaries.kubectl), "--kubeconfig", str(self.kubeconfig), *args],
                              input=input, text=True, capture_output=True, check=check,
                              timeout=timeout)

    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.workdir / "pki" / "apiserver.crt"))

    def ready(self) -> bool:
        req = urllib.request.Request(f"{self.apiserver_url}/readyz",
                                     headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(req, timeout=3, context=self.ssl_context()) as r:
            return r.status == 200

    def install_crds(self, crds_dir: Path = CRDS_DIR, timeout: float = 60) -> None:
        """``kubectl apply`` every CRD in ``crds_dir`` and wait until each is Established."""
        files = sorted(crds_dir.glob("*.yaml"))
        if not files:
            raise FileNotFoundError(f"no CRD manifests in {crds_dir}")
        for f in files:
            self.kubectl("apply", "--server-side", "-f", str(f))
        self.kubectl("wait", "--for=condition=Established", "--timeout", f"{int(timeout)}s",
                     *[f"-f={f}" for f in files], timeout=timeout + 10)

    def stop(self) -> None:
        """Stop every process (extras first, then apiserver, then etcd); remove the workdir."""
        for p in reversed(self.extra):
            p.stop()
        self.apiserver.stop()
        self.kube_etcd.stop()
        self.etcd.stop()
        if not self.keep_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> ControlPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _write_pki(pki: Path) -> None:
    pki.mkdir(parents=True, exist_ok=True)
    key = pki / "sa.key"
    if not key.exists():
        try:
            subprocess.run(["openssl", "genrsa", "-out", str(key), "2048"], check=True,
                           capture_output=True)
            subprocess.run(["openssl", "rsa", "-in", str(key), "-pubout", "-out", str(pki / "sa.pub")],
                           check=True, capture_output=True)
        except FileNotFoundError as e:
            raise ProcessFailed("openssl is needed to make the service-account signing key "
                                "(apt-get install openssl)") from e


def _write_kubeconfig(path: Path, server: str, ca: Path, token: str) -> None:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "mlx-fleet-dev", "cluster": {"server": server,
                                                            "certificate-authority": str(ca)}}],
        "users": [{"name": "admin", "user": {"token": token}}],
        "contexts": [{"name": "mlx-fleet-dev", "context": {"cluster": "mlx-fleet-dev", "user": "admin",
                                                            "namespace": "default"}}],
        "current-context": "mlx-fleet-dev",
    }, indent=2))
    path.chmod(0o600)


def apiserver_access_args(node_name: str) -> list[str]:
    """Authorization and admission flags of kube-apiserver: without a node, RBAC alone and no
    ServiceAccount admission (nothing runs Pods); with one (``node_name``), the Node authorizer
    and NodeRestriction for its kubelet, ServiceAccount admission so that Pods get tokens, and
    the kubelet reached by its InternalIP (``kubectl logs``; its hostname resolves nowhere)."""
    if node_name:
        return ["--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
                "--kubelet-preferred-address-types=InternalIP"]
    return ["--authorization-mode=RBAC", "--disable-admission-plugins=ServiceAccount"]


def start_control_plane(workdir: Path | None = None, *, binaries: Binaries | None = None,
                        install_crds: bool = True, keep_workdir: bool = False,
                        timeout: float = 120.0, node_name: str = "",
                        node_address: str = "") -> ControlPlane:
    """Start etcd ×2 and kube-apiserver on loopback, write a kubeconfig, install the CRDs.

    ``workdir``: where data, PKI, logs and the kubeconfig go (default: a new temp dir).
    ``node_name``: prepare for a real node of that name (:func:`apiserver_access_args`, and a
    token for its kubelet in ``ControlPlane.node_token``); start it with
    :func:`mlx_fleet.devcluster.node.start_node`. ``node_address``: the API server listens on
    (and advertises) this local address instead of 127.0.0.1, so that the in-cluster
    ``kubernetes`` Service gets an endpoint (the API server refuses a loopback one); it must
    already be on the host (:func:`mlx_fleet.devcluster.node.claim_host`).
    Blocks until ``/readyz`` is OK. On any failure, everything started so far is stopped and
    :class:`ProcessFailed` is raised naming the component and its log file.
    """
    binaries = binaries or ensure_all()
    workdir = Path(workdir or tempfile.mkdtemp(prefix="mlx-fleet-dev-"))
    workdir.mkdir(parents=True, exist_ok=True)
    started: list = []
    try:
        etcd = start_etcd(workdir, binaries, "etcd-fleet")
        started.append(etcd)
        kube_etcd = start_etcd(workdir, binaries, "etcd-kube")
        started.append(kube_etcd)

        pki = workdir / "pki"
        _write_pki(pki)
        token = secrets.token_hex(16)
        tokens = f'{token},admin,admin-uid,"system:masters"\n'
        node_token = secrets.token_hex(16) if node_name else ""
        if node_name:
            tokens += f'{node_token},system:node:{node_name},node-{node_name},"system:nodes"\n'
        (pki / "tokens.csv").write_text(tokens)
        port = free_port()
        address = node_address or "127.0.0.1"
        url = f"https://{address}:{port}"
        apiserver = ManagedProcess("kube-apiserver", [
            binaries.kube_apiserver,
            f"--etcd-servers={kube_etcd.client_url}",
            f"--bind-address={address}", f"--advertise-address={address}",
            f"--secure-port={port}", f"--cert-dir={pki}",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            "--service-cluster-ip-range=10.0.0.0/24",
            *apiserver_access_args(node_name),
            f"--token-auth-file={pki / 'tokens.csv'}",
            "--allow-privileged=true",
            "--enable-priority-and-fairness=false",
            "--profiling=false",
            "-v=1",
        ], workdir / "logs" / "kube-apiserver.log")
        cp = ControlPlane(workdir=workdir, binaries=binaries, etcd=etcd, kube_etcd=kube_etcd,
                          apiserver=apiserver, apiserver_url=url, kubeconfig=workdir / "kubeconfig",
                          token=token, keep_workdir=keep_workdir, node_name=node_name,
                          node_token=node_token)
        started.append(apiserver)
        # The serving certificate (and its self-signed CA, in the same file) appears in cert-dir
        # when the apiserver starts; wait for it before using it as the trust anchor.
        apiserver.wait_until(lambda: (pki / "apiserver.crt").exists(), timeout=timeout,
                             what="writing its serving certificate")
        _write_kubeconfig(cp.kubeconfig, url, pki / "apiserver.crt", token)
        apiserver.wait_until(cp.ready, timeout=timeout, what="ready (/readyz)")
        if install_crds:
            cp.install_crds()
        return cp
    except BaseException:
        for s in reversed(started):
            s.stop()
        if not keep_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        raise
