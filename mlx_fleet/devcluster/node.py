"""A real Kubernetes node in the local control plane: containerd, kubelet, kube-proxy, and the
kube-controller-manager and kube-scheduler a Helm-installed Deployment needs.

Linux, root, offline (``docs/development.md``, "A real node"). :func:`start_node` provisions what
is missing (Debian packages through apt-get, the Go-built components, the pause image), then
starts, in order: a local-only node address, containerd, the controller-manager and scheduler,
the kubelet and kube-proxy, and returns once the Node is Ready. :meth:`Node.stop` undoes all of
it: Pods' containers, processes, mounts, the address's link, iptables rules and sysctls.

The decisions (the configs, which sysctls to restore, Node readiness) are the plain functions of
:mod:`mlx_fleet.devcluster.nodeconfig`; this module only gathers inputs and applies them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mlx_fleet.devcluster.binaries import (
    BuildError,
    NodeBinaries,
    ProgressFn,
    cache_dir,
    ensure_node_binaries,
)
from mlx_fleet.devcluster.controlplane import ControlPlane
from mlx_fleet.devcluster.nodeconfig import (
    NodeSpec,
    cni_conflist,
    containerd_config,
    kubelet_config,
    node_ready,
    sysctls_to_restore,
    tables_to_flush,
)
from mlx_fleet.devcluster.images import PAUSE_REF, ensure_pause_image, import_images
from mlx_fleet.devcluster.processes import ManagedProcess, ProcessFailed, free_port

#: Debian packages the node needs, by the command that shows each is installed.
HOST_PACKAGES: dict[str, str] = {
    "containerd": "containerd", "runc": "runc", "containernetworking-plugins": "/usr/lib/cni/bridge",
    "debootstrap": "debootstrap", "iptables": "iptables", "conntrack": "conntrack",
    "buildah": "buildah",
}
CNI_BIN_DIR = Path("/usr/lib/cni")

#: Kernel settings the kubelet and kube-proxy change (kubelet: its "protect kernel defaults"
#: values; kube-proxy: route_localnet for localhost NodePorts, ip_forward through the bridge);
#: read before the node starts and written back by :meth:`Node.stop`.
WATCHED_SYSCTLS = ("vm.overcommit_memory", "vm.panic_on_oom", "kernel.panic", "kernel.panic_on_oops",
                   "kernel.keys.root_maxkeys", "kernel.keys.root_maxbytes",
                   "net.ipv4.conf.all.route_localnet", "net.ipv4.ip_forward",
                   "net.netfilter.nf_conntrack_max")

StepFn = Callable[[str, float], None]
"""``step(what, seconds)``: reports each provisioning or start-up step as it completes."""


class NodeFailed(RuntimeError):
    """The node could not be provisioned or started; the message is one readable line first."""


# ---- host I/O ------------------------------------------------------------------------------

def _run(*argv: str | Path, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, input=input)
    if check and proc.returncode != 0:
        raise NodeFailed(f"`{' '.join(map(str, argv))}` failed (exit {proc.returncode}): "
                         f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def missing_packages() -> list[str]:
    """The :data:`HOST_PACKAGES` not installed (their command or file absent)."""
    return [pkg for pkg, probe in HOST_PACKAGES.items()
            if not (Path(probe).exists() if probe.startswith("/") else shutil.which(probe))]


def ensure_host_packages(step: StepFn | None = None) -> None:
    """``apt-get install`` the missing :data:`HOST_PACKAGES` (nothing when all are there).
    Raises :class:`NodeFailed` when not root or apt fails."""
    missing = missing_packages()
    if not missing:
        return
    if os.geteuid() != 0:
        raise NodeFailed(f"the node needs root to install {', '.join(missing)}")
    started = time.monotonic()
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update", "-q"],
                 ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]):
        proc = subprocess.run(argv, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise NodeFailed(f"`{' '.join(argv[:2])}` failed: {' | '.join(tail)}")
    if step:
        step(f"apt-get install {' '.join(missing)}", time.monotonic() - started)


def read_sysctls(keys: tuple[str, ...] = WATCHED_SYSCTLS) -> dict[str, str]:
    """Current values of ``keys`` that exist on this kernel."""
    out: dict[str, str] = {}
    for key in keys:
        path = Path("/proc/sys") / key.replace(".", "/")
        with contextlib.suppress(OSError):
            out[key] = path.read_text().strip()
    return out


def write_sysctls(values: Mapping[str, str]) -> None:
    for key, value in values.items():
        with contextlib.suppress(OSError):
            (Path("/proc/sys") / key.replace(".", "/")).write_text(value + "\n")


def _iptables_save() -> dict[str, str]:
    return {tool: _run(f"{tool}-save", check=False).stdout for tool in ("iptables", "ip6tables")}


def _iptables_restore(saved: Mapping[str, str]) -> None:
    """Put back the tables ``saved`` held; tables it did not hold (created by the kubelet or
    kube-proxy) are flushed and their chains deleted (the empty tables themselves stay)."""
    for tool, text in saved.items():
        if text.strip():
            _run(f"{tool}-restore", input=text, check=False)
        for table in tables_to_flush(text):
            _run(tool, "-t", table, "-F", check=False)
            _run(tool, "-t", table, "-X", check=False)


def _mounts_under(roots: list[Path]) -> list[str]:
    """Mount points below any of ``roots``, deepest first (from /proc/self/mountinfo)."""
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if any(point == str(r) or point.startswith(f"{r}/") for r in roots):
            points.append(point)
    return sorted(set(points), key=len, reverse=True)


def _remove_cgroups(name: str = "kubepods") -> None:
    """rmdir the kubelet's (now empty) ``kubepods`` cgroups in every v1 hierarchy."""
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        top = hierarchy / name
        if not top.is_dir():
            continue
        for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts),
                        reverse=True) + [top]:
            with contextlib.suppress(OSError):
                d.rmdir()


@dataclass
class Node:
    """A running node; :meth:`stop` tears everything down (also on ``with`` exit)."""

    spec: NodeSpec
    workdir: Path
    containerd_address: Path
    processes: list[ManagedProcess] = field(default_factory=list)
    kube_proxy: ManagedProcess | None = None
    kube_proxy_error: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    _undo: list[Callable[[], None]] = field(default_factory=list)

    def stop(self) -> None:
        """Stop the kubelet, then remove the Pods' containers (so that nothing restarts them),
        stop the other processes (newest first), unmount what they mounted, delete the links,
        restore iptables and sysctls. Best effort: every step runs; a second call does nothing."""
        for undo in reversed(self._undo):
            with contextlib.suppress(Exception):
                undo()
        self._undo.clear()

    def _kill_containers(self) -> None:
        if not self.containerd_address.exists():
            return
        base = ["ctr", "--address", str(self.containerd_address), "-n", "k8s.io"]
        tasks = _run(*base, "tasks", "ls", "-q", check=False).stdout.split()
        for task in tasks:
            _run(*base, "tasks", "kill", "-s", "SIGKILL", task, check=False)
        for task in tasks:
            _run(*base, "tasks", "delete", "-f", task, check=False)
        for c in _run(*base, "containers", "ls", "-q", check=False).stdout.split():
            _run(*base, "containers", "delete", c, check=False)

    def __enter__(self) -> Node:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _wait_for(what: str, check: Callable[[], bool], timeout: float,
              proc: ManagedProcess | None = None) -> None:
    if proc is not None:
        proc.wait_until(check, timeout=timeout, what=what)
        return
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(Exception):
            if check():
                return
        if time.monotonic() > deadline:
            raise NodeFailed(f"not {what} after {timeout:.0f}s")
        time.sleep(0.1)


def _kubeconfig(path: Path, server: str, ca: Path, user: str, token: str) -> Path:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "local", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": user}}],
        "current-context": "local",
    }))
    path.chmod(0o600)
    return path


def check_host() -> None:
    """Raise :class:`NodeFailed` (one line) unless this is Linux, root and cgroup-capable."""
    if not sys.platform.startswith("linux"):
        raise NodeFailed("a real node needs Linux (the kubelet and containerd run on the host)")
    if os.geteuid() != 0:
        raise NodeFailed("a real node needs root (containerd, the kubelet, iptables, links)")


def provision(step: StepFn | None = None, progress: ProgressFn | None = None) -> NodeBinaries:
    """Everything the node needs before it starts, each step skipped when already done:
    Debian packages, the Go-built components, the pause image. Returns the binaries."""
    check_host()
    ensure_host_packages(step)
    started = time.monotonic()
    try:
        binaries = ensure_node_binaries(progress)
        if step:
            step("node binaries", time.monotonic() - started)
        started = time.monotonic()
        ensure_pause_image()
        if step:
            step("pause image", time.monotonic() - started)
    except BuildError as e:
        raise NodeFailed(str(e).splitlines()[0]) from e
    return binaries


def claim_host(spec: NodeSpec | None = None, step: StepFn | None = None) -> Node:
    """Prepare the host for a node before its control plane starts (the API server listens on
    the node address, so that the in-cluster ``kubernetes`` Service has a routable endpoint):
    install missing packages, take the machine's node lock (one local node at a time), record
    the sysctls and iptables rules to give back, and add the node address (a bridge with the /32,
    and an iptables rule dropping traffic to it that is not local). Returns a :class:`Node` not
    yet started; its :meth:`Node.stop` undoes this. Raises :class:`NodeFailed`.
    """
    import tempfile

    from filelock import FileLock, Timeout

    check_host()
    ensure_host_packages(step)
    spec = spec or NodeSpec()
    state_root = cache_dir() / "node"
    state_root.mkdir(parents=True, exist_ok=True)
    lock = FileLock(state_root / "node.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise NodeFailed(f"another local node is running on this machine (lock {lock.lock_file})") from None
    workdir = Path(tempfile.mkdtemp(prefix="mlx-fleet-node-"))
    node = Node(spec=spec, workdir=workdir, containerd_address=workdir / "containerd.sock")
    node._undo.append(lock.release)
    node._undo.append(lambda: shutil.rmtree(workdir, ignore_errors=True))
    try:
        sysctls_before, iptables_before = read_sysctls(), _iptables_save()
        node._undo.append(lambda: write_sysctls(sysctls_to_restore(sysctls_before, read_sysctls())))
        node._undo.append(lambda: _iptables_restore(iptables_before))
        _run("ip", "link", "del", spec.link, check=False)  # left by a killed run
        _run("ip", "link", "add", spec.link, "type", "bridge")
        node._undo.append(lambda: _run("ip", "link", "del", spec.link, check=False))
        node._undo.append(lambda: _run("ip", "link", "del", spec.cni_bridge, check=False))
        _run("ip", "addr", "add", f"{spec.address}/32", "dev", spec.link)
        _run("ip", "link", "set", spec.link, "up")
        _run("iptables", "-I", "INPUT", "-d", f"{spec.address}/32", "!", "-i", "lo", "-j", "DROP")
    except BaseException:
        node.stop()
        raise
    return node


def start_node(cp: ControlPlane, node: Node, *, images: Sequence[str] = (),
               step: StepFn | None = None, progress: ProgressFn | None = None, timeout: float = 180.0,
               kube_proxy: bool = True) -> Node:
    """Provision (:func:`provision`) and start ``node`` (from :func:`claim_host`) for ``cp``
    (started with ``node_name``/``node_address`` of ``node.spec``); import ``images`` (buildah
    refs, e.g. :data:`~mlx_fleet.devcluster.images.OPERATOR_REF`) into its containerd; return
    once the Node is Ready. ``kube_proxy``: also run kube-proxy (iptables mode); if it fails to
    start, the node runs without it and :attr:`Node.kube_proxy_error` says why. Raises
    :class:`NodeFailed` (or :class:`ProcessFailed` naming a log) after undoing everything
    (``node`` included).
    """
    spec, workdir = node.spec, node.workdir
    if cp.node_name != spec.name or not cp.node_token:
        node.stop()
        raise NodeFailed(f"start the control plane with node_name={spec.name!r} (Node authorizer, "
                         "ServiceAccount admission and the kubelet's token)")
    state_root = cache_dir() / "node"
    t0 = time.monotonic()

    def done(what: str, since: float) -> float:
        now = time.monotonic()
        node.timings[what] = now - since
        if step:
            step(what, now - since)
        return now

    try:
        binaries = provision(step, progress)
        t0 = time.monotonic()
        # containerd: images and snapshots cached across runs, state per run.
        cni_conf = workdir / "cni"
        cni_conf.mkdir(exist_ok=True)
        (cni_conf / "10-mlx-fleet.conflist").write_text(json.dumps(cni_conflist(spec), indent=2))
        default = _run("containerd", "config", "default").stdout
        config = workdir / "containerd.toml"
        config.write_text(containerd_config(default, pause_ref=PAUSE_REF, cni_bin_dir=CNI_BIN_DIR,
                                            cni_conf_dir=cni_conf))
        root, state = state_root / "containerd", workdir / "containerd-state"
        containerd = ManagedProcess("containerd", [
            "containerd", "--config", config, "--root", root, "--state", state,
            "--address", node.containerd_address, "--log-level", "warn",
        ], cp.logs_dir / "containerd.log")
        node.processes.append(containerd)
        node._undo.append(lambda: _unmount_all([state, workdir]))
        node._undo.append(containerd.stop)
        containerd.wait_until(lambda: _run("ctr", "--address", node.containerd_address,
                                           "version").returncode == 0,
                              timeout=60, what="serving its socket")
        t = done("containerd ready", t0)
        import_images(node.containerd_address, [PAUSE_REF, *images], step)
        t = done("images imported", t)

        # controller-manager and scheduler: ReplicaSets, ServiceAccount tokens, kube-root-ca.crt,
        # scheduling.
        pki = cp.workdir / "pki"
        admin = cp.kubeconfig
        cm = ManagedProcess("kube-controller-manager", [
            binaries.kube_controller_manager, f"--kubeconfig={admin}",
            f"--authentication-kubeconfig={admin}", f"--authorization-kubeconfig={admin}",
            "--bind-address=127.0.0.1", f"--secure-port={free_port()}",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={pki / 'apiserver.crt'}", "--leader-elect=false",
            "--v=1",
        ], cp.logs_dir / "kube-controller-manager.log")
        node.processes.append(cm)
        node._undo.append(cm.stop)
        sched = ManagedProcess("kube-scheduler", [
            binaries.kube_scheduler, f"--kubeconfig={admin}",
            f"--authentication-kubeconfig={admin}", f"--authorization-kubeconfig={admin}",
            "--bind-address=127.0.0.1", f"--secure-port={free_port()}", "--leader-elect=false", "--v=1",
        ], cp.logs_dir / "kube-scheduler.log")
        node.processes.append(sched)
        node._undo.append(sched.stop)

        # kubelet
        kubelet_root = workdir / "kubelet"
        kubelet_root.mkdir(exist_ok=True)
        kcfg = workdir / "kubelet-config.json"
        kcfg.write_text(json.dumps(kubelet_config(
            spec, port=free_port(), healthz_port=free_port(),
            runtime_endpoint=f"unix://{node.containerd_address}", pod_logs_dir=workdir / "pod-logs"),
            indent=2))
        kubeconfig = _kubeconfig(workdir / "kubelet.kubeconfig", cp.apiserver_url,
                                 pki / "apiserver.crt", f"system:node:{spec.name}", cp.node_token)
        kubelet = ManagedProcess("kubelet", [
            binaries.kubelet, f"--config={kcfg}", f"--kubeconfig={kubeconfig}",
            f"--root-dir={kubelet_root}", f"--node-ip={spec.address}",
            f"--hostname-override={spec.name}", "--v=1",
        ], cp.logs_dir / "kubelet.log")
        node.processes.append(kubelet)
        node._undo.append(_remove_cgroups)
        node._undo.append(lambda: _unmount_all([kubelet_root]))
        node._undo.append(node._kill_containers)
        node._undo.append(kubelet.stop)

        if kube_proxy:
            _start_kube_proxy(node, cp, binaries, admin)
        kubelet.wait_until(lambda: node_ready(json.loads(
            cp.kubectl("get", "node", spec.name, "-o", "json", timeout=10).stdout)),
            timeout=timeout, what=f"Node {spec.name} Ready")
        done("node Ready", t)
        node.timings["total"] = time.monotonic() - t0
        return node
    except BaseException:
        node.stop()
        raise


def _start_kube_proxy(node: Node, cp: ControlPlane, binaries: NodeBinaries, kubeconfig: Path) -> None:
    """kube-proxy in iptables mode (conntrack sysctls left alone); on failure record why."""
    healthz = free_port()
    proc = ManagedProcess("kube-proxy", [
        binaries.kube_proxy, f"--kubeconfig={kubeconfig}", f"--hostname-override={node.spec.name}",
        "--proxy-mode=iptables", f"--cluster-cidr={node.spec.pod_cidr}",
        f"--healthz-bind-address=127.0.0.1:{healthz}",
        f"--metrics-bind-address=127.0.0.1:{free_port()}",
        "--conntrack-max-per-core=0", "--conntrack-tcp-timeout-established=0",
        "--conntrack-tcp-timeout-close-wait=0", "--v=1",
    ], cp.logs_dir / "kube-proxy.log")
    node.processes.append(proc)
    node._undo.append(proc.stop)

    def healthy() -> bool:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{healthz}/healthz", timeout=2) as r:
            return r.status == 200

    try:
        proc.wait_until(healthy, timeout=60, what="healthy")
        node.kube_proxy = proc
    except ProcessFailed as e:
        node.kube_proxy_error = str(e).splitlines()[0]
        proc.stop()


def _unmount_all(roots: list[Path]) -> None:
    for point in _mounts_under(roots):
        _run("umount", "-l", point, check=False)
