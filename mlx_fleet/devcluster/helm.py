"""Build and cache ``helm`` from the Go module proxy, like :mod:`mlx_fleet.devcluster.binaries`.

Helm is used to lint and render the chart in ``charts/mlx-fleet`` (tests and docs). This project's
machines reach only package registries, so helm is built from ``helm.sh/helm/v3/cmd/helm`` at a
pinned version into ``$MLX_FLEET_CACHE/bin/helm-<version>/helm`` (default ``~/.cache/mlx-fleet``).
The first build takes a few minutes on two cores; every later call returns at once.

Helm's go.mod has no ``replace`` directives, so a wrapper module that requires it is enough. The
wrapper also pins helm's ``k8s.io/*`` dependencies of the same minor as
:data:`~mlx_fleet.devcluster.binaries.KUBERNETES_VERSION` to that exact patch release, so the Go
build cache already holds most packages when kube-apiserver/kubectl were built first (a patch
bump within the minor that helm itself was tested with).
"""

from __future__ import annotations

import re
from pathlib import Path

from mlx_fleet.devcluster.binaries import (
    KUBERNETES_VERSION,
    ProgressFn,
    build_once,
    cache_dir,
    go_build,
    go_run,
    install_built,
    module_gomod,
)

#: Pinned helm release. v3.19.x is built against the Kubernetes 1.34 client libraries.
HELM_VERSION = "v3.19.5"

_HELM_MODULE = "helm.sh/helm/v3"


def helm_path() -> Path:
    """Where the cached helm binary lives (whether or not it has been built yet)."""
    return cache_dir() / "bin" / f"helm-{HELM_VERSION}" / "helm"


def _aligned_k8s_requires(helm_gomod: str) -> list[str]:
    """``k8s.io/<m> v0.<minor>.<patch>`` lines for helm's k8s.io modules of our Kubernetes minor."""
    minor_patch = KUBERNETES_VERSION.removeprefix("v1.")
    minor = minor_patch.split(".")[0]
    mods = re.findall(rf"^\s*(k8s\.io/[\w.-]+)\s+v0\.{minor}\.\d+\s*$", helm_gomod, re.M)
    return [f"\t{m} v0.{minor_patch}" for m in sorted(set(mods))]


def ensure_helm(progress: ProgressFn | None = None) -> Path:
    """Return the path of a cached helm ``HELM_VERSION`` binary, building it first if needed.

    Raises :class:`~mlx_fleet.devcluster.binaries.BuildError` if ``go`` fails; the message names
    the log file with the full output.
    """
    exe = helm_path()
    dest = exe.parent

    def build(work: Path, log: Path) -> Path:
        k8s = _aligned_k8s_requires(module_gomod(work, log, _HELM_MODULE, HELM_VERSION))
        (work / "go.mod").write_text(
            "module mlxfleet.local/helmbuild\n\ngo 1.24.0\n\n"
            f"require (\n\t{_HELM_MODULE} {HELM_VERSION}\n" + "".join(f"{r}\n" for r in k8s) + ")\n"
        )
        # The tools-file idiom: lets `go mod tidy` resolve the command's dependency graph.
        (work / "tools.go").write_text(
            f'//go:build tools\n\npackage tools\n\nimport _ "{_HELM_MODULE}/cmd/helm"\n'
        )
        go_run(["go", "mod", "tidy"], work, log, "go mod tidy (helm)")
        # The same version stamps as helm's Makefile: `helm version` and the default
        # Capabilities.KubeVersion used by `helm template` / `helm lint`.
        k8s_minor = KUBERNETES_VERSION.lstrip("v").split(".")[1]
        ldflags = " ".join([
            "-s -w",
            f"-X {_HELM_MODULE}/internal/version.version={HELM_VERSION}",
            f"-X {_HELM_MODULE}/internal/version.gitTreeState=clean",
            f"-X {_HELM_MODULE}/pkg/lint/rules.k8sVersionMajor=1",
            f"-X {_HELM_MODULE}/pkg/lint/rules.k8sVersionMinor={k8s_minor}",
            f"-X {_HELM_MODULE}/pkg/chartutil.k8sVersionMajor=1",
            f"-X {_HELM_MODULE}/pkg/chartutil.k8sVersionMinor={k8s_minor}",
        ])
        go_build(work, {"helm": f"{_HELM_MODULE}/cmd/helm"}, ldflags, log, f"helm {HELM_VERSION}", progress)
        install_built(work, ["helm"], dest)
        return exe

    return build_once(f"helm-{HELM_VERSION}", lambda: exe if exe.is_file() else None, build)
