"""Source URIs and the mirror manifest, parsed and checked: a pure decision (no I/O).

``hf://<org>/<repo>[@<revision>]`` → ``(repo_id, revision or None)`` (:func:`parse_hf_uri`).
``https://host/path/`` (or ``…/manifest.json``) → the mirror's base URL ending in ``/``
(:func:`mirror_base_url`) and the directory it is downloaded into (:func:`mirror_dir`).

The manifest (:data:`MANIFEST_NAME`, at the mirror's base URL), UTF-8 JSON::

    {"files": [{"path": "config.json", "size": 454, "sha256": "<64 hex>"},
               {"path": "model.safetensors", "size": 593251, "sha256": "<64 hex>"}]}

``path``: relative, ``/``-separated, no ``.``/``..``/empty segment, no backslash; it must
list ``config.json``. ``size`` (bytes, a whole number ≥ 0) and ``sha256`` (64 hex digits) are
required on every entry: a download is bounded by its declared size (the disk check before the
first byte, and no byte beyond it, whatever the transfer encoding) and verified by its digest
before it is moved into place. :func:`parse_manifest` gives :class:`ManifestEntry` records,
``config.json`` first.

Every function here raises :class:`~node_agent.model_dir.SourceError` ``InvalidSource``
naming the URI or manifest entry and the problem.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

from mlx_fleet.mirror_manifest import MANIFEST_NAME  # the writer: mlx-fleet make-manifest

from ..model_dir import SourceError

#: The manifest as fetched, plus ``complete``, kept in the download directory.
STATE_FILE = ".mlx-fleet-download.json"
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")
_HUB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_HUB_REVISION = re.compile(r"^[A-Za-z0-9._][A-Za-z0-9._/-]{0,254}$")


def parse_hf_uri(uri: str) -> tuple[str, str | None]:
    """``hf://org/repo[@revision]`` → ``("org/repo", revision or None)``.
    Raises :class:`SourceError` ``InvalidSource`` for anything else."""
    raw = uri.strip()
    if not raw.lower().startswith("hf://"):
        raise SourceError("InvalidSource", f"not an hf:// URI: {uri!r}")
    rest = raw[5:]
    repo, sep, revision = rest.partition("@")
    parts = repo.split("/")
    if (len(parts) != 2 or not all(_HUB_NAME.match(p) for p in parts)
            or any(".." in p or "--" in p for p in parts)):
        raise SourceError("InvalidSource",
                          f"expected hf://<org>/<repo>[@<revision>], got {uri!r} (names: letters, "
                          "digits, '.', '_', '-'; no '..' or '--')")
    if sep and (not _HUB_REVISION.match(revision) or ".." in revision
                or revision.endswith("/")):
        raise SourceError("InvalidSource", f"invalid revision {revision!r} in {uri!r}")
    return repo, (revision if sep else None)


def mirror_base_url(uri: str) -> str:
    """The mirror directory URL of an ``https://`` source, ending in ``/`` (a trailing
    ``manifest.json`` is dropped). Raises ``InvalidSource`` for credentials, a query or
    fragment, or no host."""
    raw = uri.strip()
    parts = urlsplit(raw)
    if parts.scheme.lower() != "https" or not parts.hostname:
        raise SourceError("InvalidSource", f"expected https://host/path/, got {uri!r}")
    if parts.username is not None or parts.password is not None:
        raise SourceError("InvalidSource", f"credentials in a source URI are refused (they would "
                                           f"be copied into reports): {parts.hostname}")
    if parts.query or parts.fragment:
        raise SourceError("InvalidSource", f"a query or fragment in a mirror URI is not "
                                           f"supported: {uri!r}")
    try:
        port = parts.port
    except ValueError as e:
        raise SourceError("InvalidSource", f"bad port in {uri!r}: {e}") from e
    path = parts.path or "/"
    if path.endswith("/" + MANIFEST_NAME):
        path = path[: -len(MANIFEST_NAME)]
    if not path.endswith("/"):
        path += "/"
    if any(seg in (".", "..") for seg in path.split("/")):
        raise SourceError("InvalidSource", f"'.' or '..' in the mirror path of {uri!r}")
    netloc = parts.hostname if port is None else f"{parts.hostname}:{port}"
    if ":" in parts.hostname:  # IPv6 literal
        netloc = f"[{parts.hostname}]" + (f":{port}" if port is not None else "")
    return f"https://{netloc.lower()}{path}"


def mirror_dir(uri: str, dest_root: str | os.PathLike) -> Path:
    """The directory an ``https://`` source is downloaded into:
    ``dest_root/https/<host>-<port>-<path>-<16 hex of sha256(base URL)>``."""
    base = mirror_base_url(uri)
    parts = urlsplit(base)
    label = f"{parts.hostname}-{parts.port or 443}-{parts.path.strip('/')}"
    label = re.sub(r"[^A-Za-z0-9._-]+", "-", label).strip("-.")[:80] or "mirror"
    digest = hashlib.sha256(base.encode()).hexdigest()[:16]
    return Path(dest_root) / "https" / f"{label}-{digest}"


@dataclass(frozen=True)
class ManifestEntry:
    """One file of a mirror: ``path`` relative (``/``-separated), ``size`` in bytes and
    ``sha256`` (lower-case hex)."""

    path: str
    size: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "sha256": self.sha256}


def _safe_relpath(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise SourceError("InvalidSource", f"{where}: 'path' must be a non-empty string")
    bad = (value.startswith("/") or "\\" in value or "\x00" in value
           or any(seg in ("", ".", "..") for seg in value.split("/"))
           or value.endswith(".part") or value == STATE_FILE or ":" in value.split("/")[0])
    if bad:
        raise SourceError("InvalidSource",
                          f"{where}: unsafe path {value!r} (must be relative, '/'-separated, "
                          "without '.', '..' or empty segments)")
    return value


def parse_manifest(raw: bytes | str, source: str = MANIFEST_NAME) -> list[ManifestEntry]:
    """Parse and check a mirror manifest (format in the module docstring); ``config.json`` is
    put first. Raises :class:`SourceError` ``InvalidSource`` naming ``source`` and the problem."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SourceError("InvalidSource", f"{source} is not valid JSON: {e}") from e
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, list) or not files:
        raise SourceError("InvalidSource",
                          f"{source} must be a JSON object with a non-empty 'files' list")
    entries: list[ManifestEntry] = []
    seen: set[str] = set()
    for i, item in enumerate(files):
        where = f"{source} files[{i}]"
        if not isinstance(item, dict):
            raise SourceError("InvalidSource", f"{where} is not an object")
        path = _safe_relpath(item.get("path"), where)
        size = item.get("size")
        digest = item.get("sha256")
        missing = [k for k, v in (("size", size), ("sha256", digest)) if v is None]
        if missing:
            raise SourceError("InvalidSource",
                              f"{where} ({path}) has no {' and no '.join(map(repr, missing))}: "
                              "every file of a mirror needs its size and sha256, so that the "
                              "download is bounded and verified; nothing was downloaded")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise SourceError("InvalidSource", f"{where}: 'size' must be a non-negative integer")
        if not isinstance(digest, str) or not _HEX64.match(digest):
            raise SourceError("InvalidSource", f"{where}: 'sha256' must be 64 hex digits")
        if path in seen:
            raise SourceError("InvalidSource", f"{where}: {path!r} is listed twice")
        seen.add(path)
        entries.append(ManifestEntry(path, size, digest.lower()))
    for p in seen:
        parents = PurePosixPath(p).parents
        clash = next((str(d) for d in parents if str(d) in seen), None)
        if clash is not None:
            raise SourceError("InvalidSource", f"{source}: {clash!r} is both a file and the "
                                               f"directory of {p!r}")
    if "config.json" not in seen:
        raise SourceError("InvalidSource", f"{source} lists no config.json (not an mlx-lm model)")
    entries.sort(key=lambda e: e.path != "config.json")
    return entries
