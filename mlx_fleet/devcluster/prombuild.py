"""Build and cache ``prometheus`` and ``promtool`` from the Go module proxy, like
:mod:`mlx_fleet.devcluster.binaries` and :mod:`mlx_fleet.devcluster.helm`.

The dashboards' queries are checked against a real Prometheus scraping a local fleet, and the
metrics expositions are linted with ``promtool check metrics`` (tests, ``mlx-fleet dev up
--prometheus``). This project's machines reach only package registries, so both are built from
``github.com/prometheus/prometheus`` at a pinned module version into
``$MLX_FLEET_CACHE/bin/prometheus-<version>/`` (default ``~/.cache/mlx-fleet``). Only
``cmd/prometheus`` and ``cmd/promtool`` are built (``-trimpath``, the shared Go build cache);
the first build takes a few minutes on two cores, every later call returns at once.

Prometheus publishes its Go module as ``v0.<major><minor:02d>.<patch>``: module ``v0.307.3`` is
Prometheus 3.7.3. Its go.mod has no ``replace`` directives, so a wrapper module that requires it
is enough. The web UI's assets are not in the module zip (they are built with npm), so the
binary is built without the ``builtinassets`` tag: the HTTP API, which is all this project uses,
works; the UI pages answer 404.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mlx_fleet.devcluster.binaries import (
    ProgressFn,
    build_once,
    cache_dir,
    go_build,
    go_run,
    install_built,
)

#: Pinned Prometheus module version (Prometheus 3.7.3).
PROMETHEUS_MODULE_VERSION = "v0.307.3"

_MODULE = "github.com/prometheus/prometheus"


def release_version(module_version: str = PROMETHEUS_MODULE_VERSION) -> str:
    """``"v0.307.3"`` → ``"3.7.3"``: the Prometheus release a module version is
    (``v0.<major><minor:02d>.<patch>``, see Prometheus' RELEASE.md)."""
    _, majmin, patch = module_version.lstrip("v").split(".")
    major, minor = divmod(int(majmin), 100)
    return f"{major}.{minor}.{patch}"


@dataclasses.dataclass(frozen=True)
class PrometheusBinaries:
    """Absolute paths of the two cached executables."""

    prometheus: Path
    promtool: Path


def prometheus_dir() -> Path:
    """Where the cached binaries live (whether or not they have been built yet)."""
    return cache_dir() / "bin" / f"prometheus-{PROMETHEUS_MODULE_VERSION}"


def cached_prometheus() -> PrometheusBinaries | None:
    """The cached binaries if both are built, else ``None`` (never builds)."""
    d = prometheus_dir()
    bins = PrometheusBinaries(prometheus=d / "prometheus", promtool=d / "promtool")
    return bins if bins.prometheus.is_file() and bins.promtool.is_file() else None


def ensure_prometheus(progress: ProgressFn | None = None) -> PrometheusBinaries:
    """Return the cached ``prometheus`` and ``promtool``, building them first if needed.

    Raises :class:`~mlx_fleet.devcluster.binaries.BuildError` if ``go`` fails; the message names
    the log file with the full output.
    """

    def build(work: Path, log: Path) -> PrometheusBinaries:
        (work / "go.mod").write_text(
            "module mlxfleet.local/prometheusbuild\n\ngo 1.24.0\n\n"
            f"require {_MODULE} {PROMETHEUS_MODULE_VERSION}\n"
        )
        # The tools-file idiom: lets `go mod tidy` resolve the commands' dependency graph.
        (work / "tools.go").write_text(
            "//go:build tools\n\npackage tools\n\nimport (\n"
            f'\t_ "{_MODULE}/cmd/prometheus"\n\t_ "{_MODULE}/cmd/promtool"\n)\n'
        )
        go_run(["go", "mod", "tidy"], work, log, "go mod tidy (prometheus)")
        # The version stamps of Prometheus' .promu.yml, so `--version` reports the release.
        vpkg = "github.com/prometheus/common/version"
        ldflags = " ".join([
            "-s -w",
            f"-X {vpkg}.Version={release_version()}",
            f"-X {vpkg}.Branch=module-{PROMETHEUS_MODULE_VERSION}",
            f"-X {vpkg}.BuildUser=mlx-fleet",
            f"-X {vpkg}.BuildDate=19700101-00:00:00",
        ])
        go_build(work, {"prometheus": f"{_MODULE}/cmd/prometheus",
                         "promtool": f"{_MODULE}/cmd/promtool"},
                 ldflags, log, f"prometheus {release_version()}", progress)
        install_built(work, ["prometheus", "promtool"], prometheus_dir())
        return PrometheusBinaries(prometheus=prometheus_dir() / "prometheus",
                                  promtool=prometheus_dir() / "promtool")

    return build_once(f"prometheus-{PROMETHEUS_MODULE_VERSION}", cached_prometheus, build)
