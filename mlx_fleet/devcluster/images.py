"""Container images with no registry: a pause image, a Python base from Debian packages, and the
repository's Dockerfile built on it, imported into the local node's containerd.

This project's machines reach only package registries, so nothing is pulled:

* **pause** (the Pod sandbox): a static Go program (:data:`PAUSE_SOURCE`: wait for SIGINT/SIGTERM,
  reap children), built with the Go toolchain the control-plane builds use, committed as a
  one-file image.
* **Python base**: ``debootstrap --variant=minbase --include=python3,python3-pip,ca-certificates
  bookworm`` (Debian's Python is 3.11, the Dockerfile's ``python:3.11-slim``), trimmed of docs,
  locales and apt lists, ``EXTERNALLY-MANAGED`` removed so that pip installs system-wide, and
  committed as :data:`BASE_REF`.
* **The operator image**: the repository's ``Dockerfile``, unchanged, built by buildah
  (``buildah bud --isolation chroot``: no daemon, no namespaces the VM withholds) with
  ``--build-arg BASE_IMAGE=`` :data:`BASE_REF`. Outbound HTTPS goes through an intercepting proxy
  whose CA is only in the host's bundle, so the host's ``/etc/ssl/certs/ca-certificates.crt`` is
  bind-mounted read-only over the base's during the build's ``RUN`` steps only: a bind mount's
  content is never committed into a layer, so the shipped image keeps Debian's own bundle.

Images are kept in a buildah store under ``$MLX_FLEET_CACHE/images/`` (``--layers``: an unchanged
Dockerfile step is reused) and handed to containerd as ``docker-archive`` tarballs
(``ctr -n k8s.io images import``). Every step is skipped when its result already exists.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from mlx_fleet.devcluster.binaries import BuildError, build_once, cache_dir, go_run

log = logging.getLogger(__name__)

#: Image references. ``localhost/`` names a registry that is never contacted.
PAUSE_REF = "localhost/mlx-fleet/pause:3.10"
BASE_REF = "localhost/mlx-fleet/python-base:bookworm"
OPERATOR_REF = "localhost/mlx-fleet/mlx-fleet-operator:dev"

#: Debian release of the base: its python3 is 3.11, like the Dockerfile's default base.
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
BASE_PACKAGES = ("python3", "python3-pip", "ca-certificates")
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")

PAUSE_SOURCE = """\
// Command pause: the Pod sandbox's process (a static stand-in for registry.k8s.io/pause).
// It holds the Pod's namespaces, reaps orphaned children, and exits on SIGINT or SIGTERM.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range sigs {
		if s != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
"""

StepFn = Callable[[str, float], None]
"""``step(what, seconds)``: called after each provisioning step that did work."""


def store_dir() -> Path:
    """The buildah store (images and layer cache) under the cache directory."""
    return cache_dir() / "images" / "buildah"


def buildah(*args: str | Path, capture: bool = True, timeout: float = 1800) -> str:
    """Run ``buildah`` on the private store; returns stdout. Raises :class:`BuildError` with
    the output's tail on failure (or when buildah is missing: ``apt-get install buildah``)."""
    store = store_dir()
    argv = ["buildah", "--root", str(store / "root"), "--runroot", str(store / "run"),
            "--storage-driver", "overlay", *map(str, args)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as e:
        raise BuildError("buildah is not installed (apt-get install buildah)") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
        raise BuildError(f"buildah {args[0]} failed (exit {proc.returncode}):\n{tail}")
    return proc.stdout


def image_id(ref: str) -> str | None:
    """The buildah store's image ID (config digest) of ``ref``, or None when absent."""
    try:
        return buildah("images", "--noheading", "--no-trunc", "--format", "{{.ID}}", ref).split()[0]
    except (BuildError, IndexError):
        return None


def _commit_rootfs(rootfs: Path, ref: str, config: list[str]) -> None:
    """Commit the directory ``rootfs`` as the one-layer image ``ref`` (``buildah config`` args)."""
    ctr = buildah("from", "--pull-never", "scratch").strip()
    try:
        mnt = Path(buildah("mount", ctr).strip())
        subprocess.run(f"tar -C {rootfs} -cf - . | tar -C {mnt} -xpf -", shell=True, check=True)
        buildah("config", *config, ctr)
        buildah("commit", "--rm", ctr, ref)
    except BaseException:
        subprocess.run(["buildah", "--root", str(store_dir() / "root"), "--runroot",
                        str(store_dir() / "run"), "rm", ctr], capture_output=True)
        raise


def ensure_pause_image() -> str:
    """Build (once) the pause image :data:`PAUSE_REF`; returns its image ID."""
    def build(work: Path, build_log: Path) -> str:
        (work / "go.mod").write_text("module mlxfleet.local/pause\n\ngo 1.24\n")
        (work / "main.go").write_text(PAUSE_SOURCE)
        go_run(["go", "build", "-trimpath", "-ldflags", "-s -w", "-o", "rootfs/pause", "."],
               work, build_log, "go build (pause)")
        _commit_rootfs(work / "rootfs", PAUSE_REF,
                       ["--entrypoint", '["/pause"]', "--user", "65535:65535"])
        return image_id(PAUSE_REF) or ""

    return build_once("pause-image", lambda: image_id(PAUSE_REF), build)


def _trim_rootfs(root: Path) -> None:
    """Drop what a runtime image never reads: docs, man pages, locales, apt caches and lists."""
    for rel in ("usr/share/doc", "usr/share/man", "usr/share/info", "usr/share/locale",
                "var/cache/apt", "var/lib/apt/lists", "var/log"):
        shutil.rmtree(root / rel, ignore_errors=True)
        (root / rel).mkdir(parents=True, exist_ok=True)
    for marker in root.glob("usr/lib/python3*/EXTERNALLY-MANAGED"):
        marker.unlink()


def ensure_base_image() -> str:
    """Build (once) the Python base :data:`BASE_REF` with debootstrap; returns its image ID.

    Raises :class:`BuildError` naming debootstrap's log when it fails (apt-get install
    debootstrap; deb.debian.org must be reachable).
    """
    def build(work: Path, build_log: Path) -> str:
        rootfs = Path(tempfile.mkdtemp(prefix="rootfs-", dir=work))
        try:
            with build_log.open("a") as fh:
                proc = subprocess.run(
                    ["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
                     DEBIAN_SUITE, str(rootfs), DEBIAN_MIRROR],
                    stdout=fh, stderr=subprocess.STDOUT)
            if proc.returncode != 0:
                raise BuildError(f"debootstrap failed (exit {proc.returncode}); log: {build_log}")
            _trim_rootfs(rootfs)
            # `pip` and `python` as on the official Python images the Dockerfile defaults to.
            for name, target in (("python", "python3"), ("pip", "pip3")):
                link = rootfs / "usr" / "bin" / name
                if not link.exists():
                    link.symlink_to(target)
            _commit_rootfs(rootfs, BASE_REF, [
                "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "--env", "LANG=C.UTF-8", "--cmd", "python3"])
        finally:
            shutil.rmtree(rootfs, ignore_errors=True)
        return image_id(BASE_REF) or ""

    return build_once(f"python-base-{DEBIAN_SUITE}", lambda: image_id(BASE_REF), build)


def build_operator_image(repo: Path, *, ca_bundle: Path = HOST_CA_BUNDLE) -> str:
    """``buildah bud`` the repository's ``Dockerfile`` on :data:`BASE_REF` as
    :data:`OPERATOR_REF`; returns the image ID. ``ca_bundle`` is trusted by the build's ``RUN``
    steps only (a read-only bind mount, absent from the image). Unchanged steps come from the
    layer cache; the image this one replaces is removed from the store (not the layer cache).
    Raises :class:`BuildError` with buildah's output tail."""
    ensure_base_image()
    previous = image_id(OPERATOR_REF)
    mounts = ["--volume", f"{ca_bundle}:/etc/ssl/certs/ca-certificates.crt:ro"] if ca_bundle.is_file() else []
    buildah("bud", "--isolation", "chroot", "--layers", "--pull-never", *mounts,
            "--build-arg", f"BASE_IMAGE={BASE_REF}", "-f", repo / "Dockerfile",
            "-t", OPERATOR_REF, repo)
    built = image_id(OPERATOR_REF) or ""
    if previous and previous != built:
        try:
            buildah("rmi", previous)
        except BuildError as e:  # still used by a container: harmless, left for later
            log.warning("kept the previous operator image %s: %s", previous, e)
    return built


def read_image_file(ref: str, path: str) -> bytes:
    """The content of ``path`` in image ``ref`` (from the buildah store); raises
    :class:`BuildError` when the image is absent, ``OSError`` when the file is."""
    ctr_id = buildah("from", "--pull-never", ref).strip()
    try:
        mnt = Path(buildah("mount", ctr_id).strip())
        return (mnt / path.lstrip("/")).read_bytes()
    finally:
        buildah("rm", ctr_id)


def export_archive(ref: str, dest: Path) -> Path:
    """Write ``ref`` as a ``docker-archive`` tarball (``docker save`` format) at ``dest``."""
    dest.unlink(missing_ok=True)
    buildah("push", ref, f"docker-archive:{dest}:{ref}")
    return dest


def ctr(address: Path, *args: str, timeout: float = 600) -> str:
    """Run ``ctr -n k8s.io`` against the containerd at ``address``; returns stdout.
    Raises :class:`BuildError` with its output on failure."""
    proc = subprocess.run(["ctr", "--address", str(address), "--namespace", "k8s.io", *args],
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise BuildError(f"ctr {' '.join(args[:2])} failed: {(proc.stdout + proc.stderr).strip()}")
    return proc.stdout


def import_images(address: Path, refs: list[str], step: StepFn | None = None) -> None:
    """Import each of ``refs`` from the buildah store into the containerd at ``address``, unless
    containerd already holds that very image (its config digest is the buildah image ID)."""
    for ref in refs:
        want = image_id(ref)
        if want is None:
            raise BuildError(f"{ref} is not built")
        if want.removeprefix("sha256:") in _containerd_config_digest(address, ref):
            continue
        started = time.monotonic()
        with tempfile.TemporaryDirectory(dir=cache_dir() / "images") as tmp:
            archive = export_archive(ref, Path(tmp) / "image.tar")
            ctr(address, "images", "import", str(archive))
        if step:
            step(f"import {ref}", time.monotonic() - started)


def _containerd_config_digest(address: Path, ref: str) -> str:
    """The config digest of containerd's image ``ref`` ('' when absent or unreadable)."""
    try:
        for line in ctr(address, "images", "ls").splitlines()[1:]:
            fields = line.split()
            if fields[:1] == [ref]:
                manifest = json.loads(ctr(address, "content", "get", fields[2]))
                return manifest.get("config", {}).get("digest", "")
    except (BuildError, ValueError, IndexError):
        return ""
    return ""
