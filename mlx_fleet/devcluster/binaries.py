"""Build and cache the local control-plane binaries: etcd, kube-apiserver and kubectl.

All three are built from source through the Go module proxy, because this project's machines
reach only package registries (no release tarballs, no Docker images). Built binaries are cached
under ``$MLX_FLEET_CACHE/bin/<component>-<version>/`` (default ``~/.cache/mlx-fleet``), so the
first build takes many minutes on two cores and every later call returns at once.

* etcd: ``go install go.etcd.io/etcd/server/v3`` fails on the relative ``replace`` directives in
  etcd's own go.mod, so we build a tiny wrapper ``main`` that calls
  ``go.etcd.io/etcd/server/v3/etcdmain.Main``.
* kube-apiserver and kubectl: ``k8s.io/kubernetes``'s go.mod points every staging module
  (``k8s.io/api``, ``k8s.io/client-go``, ...) at ``./staging/...``, which does not exist in the
  module zip. The wrapper module ``replace``s each one with its published ``v0.<minor>.<patch>``
  (the list is read from that go.mod, so it follows the pinned version), then builds
  ``k8s.io/kubernetes/cmd/{kube-apiserver,kubectl}`` with ``CGO_ENABLED=0`` and version ldflags
  so that ``--version`` reports a real ``v1.<minor>.<patch>``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

#: Pinned versions. Kubernetes 1.34 is tested with etcd 3.6 (its go.mod requires etcd client 3.6).
KUBERNETES_VERSION = "v1.34.4"
ETCD_VERSION = "v3.6.16"

log = logging.getLogger(__name__)
T = TypeVar("T")

ProgressFn = Callable[[str, int, int], None]
"""``progress(label, done, total)``: called as packages compile; ``total`` may grow."""


class BuildError(RuntimeError):
    """A Go build failed; the message names the step and the log file with the full output."""


def cache_dir() -> Path:
    """Root of everything mlx-fleet caches outside the repository (``$MLX_FLEET_CACHE``)."""
    return Path(os.environ.get("MLX_FLEET_CACHE", Path.home() / ".cache" / "mlx-fleet"))


@dataclasses.dataclass(frozen=True)
class Binaries:
    """Absolute paths of the three control-plane executables."""

    etcd: Path
    kube_apiserver: Path
    kubectl: Path

    @property
    def bin_dirs(self) -> list[Path]:
        return sorted({self.etcd.parent, self.kube_apiserver.parent, self.kubectl.parent})


#: Go's built-in default proxy setting. Its ``direct`` fallback fetches from version-control
#: hosts when the proxy lacks a module; these builds must only use the module proxy, so that
#: default is narrowed. A proxy the user configured (environment or ``go env -w``) is kept.
_GO_DEFAULT_PROXY = "https://proxy.golang.org,direct"


def _go_env(work: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        CGO_ENABLED="0",
        GOFLAGS="-mod=mod -buildvcs=false",
        GOTOOLCHAIN=env.get("GOTOOLCHAIN", "auto"),
        GOWORK="off",
    )
    if _configured_goproxy() == _GO_DEFAULT_PROXY:
        env["GOPROXY"] = "https://proxy.golang.org"
    return env


@functools.cache
def _configured_goproxy() -> str:
    try:
        return subprocess.run(["go", "env", "GOPROXY"], capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except FileNotFoundError as e:
        raise BuildError("`go` is not on PATH: Go >= 1.21 is needed to build the control-plane "
                         "binaries (https://go.dev/doc/install)") from e


def go_run(cmd: list[str], cwd: Path, log: Path, step: str) -> str:
    with log.open("a") as fh:
        fh.write(f"$ {' '.join(cmd)}\n")
        fh.flush()
        proc = subprocess.run(cmd, cwd=cwd, env=_go_env(cwd), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        fh.write(proc.stdout)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.strip().splitlines()[-15:])
        raise BuildError(f"{step} failed (exit {proc.returncode}); full log: {log}\n{tail}")
    return proc.stdout


def go_build(work: Path, pkgs: dict[str, str], ldflags: str, log: Path, label: str,
              progress: ProgressFn | None) -> None:
    """``go build -v`` each ``pkgs[name]`` into ``work/out/name``, reporting compiled packages."""
    deps: set[str] = set()
    for pkg in pkgs.values():
        out = go_run(["go", "list", "-deps", pkg], work, log, f"go list {pkg}")
        deps.update(line for line in out.splitlines() if line)
    # The standard library is usually already compiled in the build cache; count it anyway
    # so the bar never overruns.
    total = max(len(deps), 1)
    done = 0
    if progress:
        progress(label, 0, total)
    (work / "out").mkdir(exist_ok=True)
    for name, pkg in pkgs.items():
        cmd = ["go", "build", "-v", "-trimpath", "-ldflags", ldflags, "-o", str(work / "out" / name), pkg]
        with log.open("a") as fh:
            fh.write(f"$ {' '.join(cmd)}\n")
            proc = subprocess.Popen(cmd, cwd=work, env=_go_env(work), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
            assert proc.stdout is not None
            tail: list[str] = []
            for line in proc.stdout:
                fh.write(line)
                tail = (tail + [line.rstrip()])[-15:]
                if line.strip() in deps:
                    done = min(done + 1, total)
                    if progress:
                        progress(label, done, total)
            rc = proc.wait()
        if rc != 0:
            raise BuildError(f"building {pkg} failed (exit {rc}); full log: {log}\n" + "\n".join(tail))
    if progress:
        progress(label, total, total)


def install_built(work: Path, names: list[str], dest: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=dest.parent))
    for name in names:
        shutil.copy2(work / "out" / name, tmp / name)
    # Atomic publish: a half-finished build never looks like a cached one.
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)


def ensure_etcd(progress: ProgressFn | None = None) -> Path:
    """Return the path of a cached etcd ``ETCD_VERSION`` binary, building it first if needed.

    Raises :class:`BuildError` if ``go`` fails; the message names the log file.
    """
    dest = cache_dir() / "bin" / f"etcd-{ETCD_VERSION}"
    exe = dest / "etcd"

    def build(work: Path, log: Path) -> Path:
        (work / "go.mod").write_text(
            "module mlxfleet.local/etcdbuild\n\ngo 1.24\n\n"
            f"require go.etcd.io/etcd/server/v3 {ETCD_VERSION}\n"
        )
        (work / "main.go").write_text(
            "// Command etcd: the etcd server, built from the Go module proxy (see binaries.py).\n"
            "package main\n\n"
            'import (\n\t"os"\n\n\t"go.etcd.io/etcd/server/v3/etcdmain"\n)\n\n'
            "func main() { etcdmain.Main(os.Args) }\n"
        )
        go_run(["go", "mod", "tidy"], work, log, "go mod tidy (etcd)")
        go_build(work, {"etcd": "."}, "-s -w", log, f"etcd {ETCD_VERSION}", progress)
        install_built(work, ["etcd"], dest)
        return exe

    return build_once(f"etcd-{ETCD_VERSION}", lambda: exe if exe.is_file() else None, build)


def build_workspace(name: str) -> tuple[Path, Path]:
    """``(work_dir, log_file)`` for building ``name`` under ``$MLX_FLEET_CACHE/build/``; creates
    the work dir and the ``bin/`` parent that :func:`install_built` publishes into."""
    (cache_dir() / "bin").mkdir(parents=True, exist_ok=True)
    work = cache_dir() / "build" / name
    work.mkdir(parents=True, exist_ok=True)
    # `go mod download` needs a module context; a bare go.mod is enough until the real one.
    (work / "go.mod").write_text(f"module mlxfleet.local/{re.sub(r'[^a-z0-9]', '', name)}build\n\ngo 1.24.0\n")
    return work, work / "build.log"


def build_once(name: str, cached: Callable[[], T | None], build: Callable[[Path, Path], T]) -> T:
    """Build ``name`` at most once, even with several ``mlx-fleet provision`` runs at once.

    ``cached()`` returns the installed result, or None while there is none; ``build(work, log)``
    builds it in ``name``'s work directory (:func:`build_workspace`) and installs it. A run that
    finds nothing cached takes an exclusive lock on ``$MLX_FLEET_CACHE/build/<name>.lock``
    (``filelock``: ``flock`` on POSIX, released by the kernel if the holder dies); when another
    run holds it, it logs that it waits (a warning on ``mlx_fleet.devcluster.binaries``) and
    waits. Holding the lock it asks ``cached()`` again, so a run that waited returns what the
    other one built. Raises what ``build`` raises (:class:`BuildError`), the lock released.
    """
    from filelock import FileLock, Timeout

    found = cached()
    if found is not None:
        return found
    lock_path = cache_dir() / "build" / f"{name}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(lock_path)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.warning("another provision is building %s; waiting for it (lock %s)", name, lock_path)
        lock.acquire()
    try:
        found = cached()
        if found is not None:
            return found
        work, build_log = build_workspace(name)
        return build(work, build_log)
    finally:
        lock.release()


def module_gomod(work: Path, log: Path, module: str, version: str) -> str:
    """The go.mod text of ``module@version``, fetched through the Go module proxy."""
    info = json.loads(go_run(["go", "mod", "download", "-json", f"{module}@{version}"], work, log,
                             f"go mod download {module}@{version}"))
    if info.get("Error"):
        raise BuildError(f"go mod download {module}@{version}: {info['Error']}")
    return Path(info["GoMod"]).read_text()


def _staging_modules(kubernetes_gomod: str) -> list[str]:
    """Module paths that ``k8s.io/kubernetes``'s go.mod replaces with ``./staging/...``."""
    return sorted(set(re.findall(r"^\s*(?:replace\s+)?(k8s\.io/[\w.-]+)\s+=>\s+\./staging/",
                                  kubernetes_gomod, re.M)))


def _build_kubernetes_commands(work: Path, log: Path, commands: list[str], label: str,
                               progress: ProgressFn | None) -> None:
    """Build ``k8s.io/kubernetes/cmd/<c>`` for each ``c`` in ``commands`` into ``work/out/<c>``.

    The wrapper module ``replace``s every staging module with its published ``v0.<minor>.<patch>``
    (the list read from ``k8s.io/kubernetes``'s go.mod), so the Go build cache is shared by every
    caller. Raises :class:`BuildError` if ``go`` fails.
    """
    staging = _staging_modules(module_gomod(work, log, "k8s.io/kubernetes", KUBERNETES_VERSION))
    if not staging:
        raise BuildError(f"found no staging replaces in k8s.io/kubernetes@{KUBERNETES_VERSION}'s go.mod")
    minor_patch = KUBERNETES_VERSION.removeprefix("v1.")
    replaces = "\n".join(f"\t{m} => {m} v0.{minor_patch}" for m in staging)
    (work / "go.mod").write_text(
        "module mlxfleet.local/k8sbuild\n\ngo 1.24.0\n\n"
        f"require k8s.io/kubernetes {KUBERNETES_VERSION}\n\n"
        f"replace (\n{replaces}\n)\n"
    )
    # The tools-file idiom: lets `go mod tidy` resolve the commands' dependency graph.
    imports = "".join(f'\t_ "k8s.io/kubernetes/cmd/{c}"\n' for c in commands)
    (work / "tools.go").write_text(f"//go:build tools\n\npackage tools\n\nimport (\n{imports})\n")
    go_run(["go", "mod", "tidy"], work, log, f"go mod tidy ({label})")
    major, minor = KUBERNETES_VERSION.lstrip("v").split(".")[:2]
    vpkg = "k8s.io/component-base/version"
    ldflags = " ".join([
        "-s -w",
        f"-X {vpkg}.gitVersion={KUBERNETES_VERSION}",
        f"-X {vpkg}.gitMajor={major}",
        f"-X {vpkg}.gitMinor={minor}",
        f"-X {vpkg}.gitTreeState=clean",
        f"-X {vpkg}.buildDate=1970-01-01T00:00:00Z",
        f"-X k8s.io/client-go/pkg/version.gitVersion={KUBERNETES_VERSION}",
    ])
    go_build(work, {c: f"k8s.io/kubernetes/cmd/{c}" for c in commands}, ldflags, log,
             f"{label} {KUBERNETES_VERSION}", progress)


def ensure_kubernetes(progress: ProgressFn | None = None) -> tuple[Path, Path]:
    """Return ``(kube_apiserver, kubectl)`` for ``KUBERNETES_VERSION``, building them if needed.

    Raises :class:`BuildError` if ``go`` fails; the message names the log file.
    """
    dest = cache_dir() / "bin" / f"kubernetes-{KUBERNETES_VERSION}"
    apiserver, kubectl = dest / "kube-apiserver", dest / "kubectl"

    def build(work: Path, log: Path) -> tuple[Path, Path]:
        _build_kubernetes_commands(work, log, ["kube-apiserver", "kubectl"], "kubernetes", progress)
        install_built(work, ["kube-apiserver", "kubectl"], dest)
        return apiserver, kubectl

    return build_once(f"kubernetes-{KUBERNETES_VERSION}", lambda: (apiserver, kubectl) if apiserver.is_file() and kubectl.is_file() else None, build)


#: The node's Kubernetes components (``mlx-fleet dev up --node``), built like kube-apiserver.
NODE_COMMANDS = ("kubelet", "kube-controller-manager", "kube-scheduler", "kube-proxy")


@dataclasses.dataclass(frozen=True)
class NodeBinaries:
    """Absolute paths of the node's Kubernetes executables (:data:`NODE_COMMANDS`)."""

    kubelet: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kube_proxy: Path


def ensure_node_binaries(progress: ProgressFn | None = None) -> NodeBinaries:
    """Return the node components of ``KUBERNETES_VERSION``, building them (once) if needed.

    Cached under ``$MLX_FLEET_CACHE/bin/kubernetes-node-<version>/``; with the Go build cache
    warm from :func:`ensure_kubernetes` the build takes about a minute and a half on two cores.
    Raises :class:`BuildError` if ``go`` fails; the message names the log file.
    """
    dest = cache_dir() / "bin" / f"kubernetes-node-{KUBERNETES_VERSION}"
    result = NodeBinaries(*(dest / c for c in NODE_COMMANDS))

    def build(work: Path, log: Path) -> NodeBinaries:
        _build_kubernetes_commands(work, log, list(NODE_COMMANDS), "kubernetes node", progress)
        install_built(work, list(NODE_COMMANDS), dest)
        return result

    return build_once(f"kubernetes-node-{KUBERNETES_VERSION}",
                      lambda: result if all((dest / c).is_file() for c in NODE_COMMANDS) else None,
                      build)


def ensure_all(progress: ProgressFn | None = None) -> Binaries:
    """Build (once) and return the three control-plane binaries."""
    etcd = ensure_etcd(progress)
    apiserver, kubectl = ensure_kubernetes(progress)
    return Binaries(etcd=etcd, kube_apiserver=apiserver, kubectl=kubectl)
