"""Resolve an assignment's model source URI to a local model directory, and check that directory.

Accepted sources:

* ``file:///abs/path`` (or ``file://localhost/abs/path``) and a bare absolute path ``/abs/path``:
  a model directory on this Mac;
* ``hf://<org>/<repo>[@<revision>]``: a Hugging Face Hub repository, through huggingface_hub and
  its cache (see :mod:`node_agent.fetch`);
* ``https://host/path/``: a mirror directory holding a ``manifest.json`` (format in
  :mod:`node_agent.fetch`), downloaded into the agent's model cache.

``http://`` is refused: weights fetched over plain HTTP can be swapped by anyone on the path.

Whatever the source, the directory is checked before anything is loaded from it
(:func:`check_model_dir`): it must hold a ``config.json`` that is a JSON object and asks for no
custom model code (``trust_remote_code`` is never enabled), and no entry in it may be a symlink
that leads out of the model's root, nor a device, FIFO or socket. A local path must not contain
``..`` segments.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

if TYPE_CHECKING:
    from mlx_fleet.contract import DownloadProgress

__all__ = ["SourceError", "resolve_source", "is_remote", "check_model_dir", "check_config",
           "REMOTE_SCHEMES", "MAX_CONFIG_BYTES"]

#: Schemes served by :mod:`node_agent.fetch` (a download into a local cache).
REMOTE_SCHEMES = frozenset({"hf", "https"})
#: Largest ``config.json`` read (bytes); a bigger one is refused as ``InvalidSource``.
MAX_CONFIG_BYTES = 16 * 2**20


class SourceError(Exception):
    """A model source can't be used. ``reason``: CamelCase machine reason; ``message``:
    human-readable detail.

    Reasons: ``ModelNotFound`` (no such directory, repository, revision or mirror),
    ``UnsupportedSource`` (unknown scheme, ``http://``), ``InvalidSource`` (malformed URI,
    unsafe path or symlink, bad ``config.json`` or manifest), ``DownloadFailed`` (HTTP error,
    connection lost too often, hub unreachable), ``DownloadStalled`` (no bytes for the stall
    timeout), ``DownloadCorrupt`` (size or sha256 mismatch)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


def _scheme(raw: str) -> str:
    return urlparse(raw).scheme.lower()


def is_remote(uri: str) -> bool:
    """True for sources that are downloaded first (``hf://``, ``https://``)."""
    return _scheme((uri or "").strip()) in REMOTE_SCHEMES


def resolve_source(uri: str, *, dest_root: str | os.PathLike | None = None,
                   progress: Callable[[DownloadProgress], None] | None = None,
                   **fetch_options: Any) -> Path:
    """``uri`` → absolute local path of a checked model directory.

    Local sources (``file://``, ``/abs``) are only checked (a few ``stat`` calls and a walk of the
    directory). Remote ones are downloaded with :func:`node_agent.fetch.fetch` into
    ``dest_root`` (default :func:`node_agent.fetch.default_model_cache`), reporting to
    ``progress``; ``fetch_options`` go to ``fetch`` (``stall_timeout_s`` ...). That blocks for
    the whole download: call it from a thread, never on a running event loop (use ``fetch``
    there), or it raises ``RuntimeError``.

    Raises :class:`SourceError`: ``UnsupportedSource`` for ``http://`` and unknown schemes;
    ``InvalidSource`` for an empty or relative path, ``..`` in a path, a ``file://`` URI with a
    host, a symlink leading out of the model directory, a ``config.json`` that isn't a JSON
    object; ``ModelNotFound`` when the directory or its ``config.json`` is missing; and the
    download reasons of :mod:`node_agent.fetch`.
    """
    raw = (uri or "").strip()
    if not raw:
        raise SourceError("InvalidSource", "the model source URI is empty")
    parsed = urlparse(raw)
    scheme = parsed.scheme.lower()
    if scheme in REMOTE_SCHEMES:
        import asyncio

        from .fetch import default_model_cache, fetch

        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError("resolve_source downloads synchronously; on an event loop await "
                               "node_agent.fetch.fetch() instead")
        root = Path(dest_root) if dest_root is not None else default_model_cache()
        return asyncio.run(fetch(raw, root, progress=progress, **fetch_options))
    if scheme == "http":
        raise SourceError("UnsupportedSource",
                          f"plain http:// is refused ({raw}): weights fetched without TLS can be "
                          "tampered with on the way; serve the mirror over https://")
    if scheme == "file":
        if parsed.netloc not in {"", "localhost"}:
            raise SourceError("InvalidSource",
                              f"file URI with a remote host {parsed.netloc!r}: {raw}")
        text = unquote(parsed.path)
    elif scheme == "":
        text = raw
    else:
        raise SourceError("UnsupportedSource", f"unknown source scheme {scheme!r} in {raw}")
    path = Path(text)
    if not path.is_absolute():
        raise SourceError("InvalidSource", f"model path must be absolute, got {raw!r}")
    if ".." in path.parts:
        raise SourceError("InvalidSource", f"model path must not contain '..' segments: {raw!r}")
    if not path.is_dir():
        raise SourceError("ModelNotFound", f"no model directory at {path}")
    check_model_dir(path)
    return path


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def check_config(model_dir: Path) -> dict[str, Any]:
    """Read ``model_dir/config.json`` and return it (a dict).

    Raises :class:`SourceError`: ``ModelNotFound`` if it is missing; ``InvalidSource`` if it is
    larger than :data:`MAX_CONFIG_BYTES`, not JSON, not a JSON object, or names custom model code
    (``model_file``: loading it would need ``trust_remote_code``, which is never enabled)."""
    config = model_dir / "config.json"
    if not config.is_file():
        raise SourceError("ModelNotFound",
                          f"{model_dir} holds no config.json (not an mlx-lm model)")
    try:
        if config.stat().st_size > MAX_CONFIG_BYTES:
            raise SourceError("InvalidSource", f"{config} is larger than {MAX_CONFIG_BYTES} bytes")
        data = json.loads(config.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SourceError("InvalidSource", f"{config} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise SourceError("InvalidSource",
                          f"{config} is not a JSON object (got {type(data).__name__})")
    if data.get("model_file") is not None:
        raise SourceError("InvalidSource",
                          f"{config} asks for custom model code ({data['model_file']!r}); "
                          "trust_remote_code is never enabled, so the model can't be loaded")
    return data


def check_model_dir(model_dir: Path, *, root: Path | None = None) -> None:
    """Refuse a model directory that isn't safe to load, before anything is loaded from it.

    ``root``: the tree every symlink must stay in (default: the model directory itself; for a
    Hugging Face cache snapshot the repository folder, whose ``blobs/`` the snapshot links to).
    Walks ``model_dir`` without following symlinks; each symlink must resolve inside ``root``
    (a link to a directory inside ``model_dir``), and every entry must be a regular file, a
    directory or such a symlink. Then :func:`check_config`.

    Raises :class:`SourceError` (``InvalidSource`` naming the entry and where it leads;
    ``ModelNotFound`` without a ``config.json``)."""
    real_dir = os.path.realpath(model_dir)
    real_root = os.path.realpath(root) if root is not None else real_dir
    if not _within(real_dir, real_root):
        raise SourceError("InvalidSource",
                          f"{model_dir} resolves to {real_dir}, outside {real_root}")
    for dirpath, dirnames, filenames in os.walk(real_dir):
        for name in [*dirnames, *filenames]:
            entry = os.path.join(dirpath, name)
            rel = os.path.relpath(entry, real_dir)
            try:
                st = os.lstat(entry)
            except OSError as e:
                raise SourceError("InvalidSource",
                                  f"cannot inspect {rel} in {model_dir}: {e}") from e
            if stat.S_ISLNK(st.st_mode):
                target = os.path.realpath(entry)
                inside = _within(target, real_root)
                if inside and os.path.isdir(target) and not _within(target, real_dir):
                    inside = False  # a linked directory's contents would escape the walk
                if not inside:
                    raise SourceError(
                        "InvalidSource",
                        f"{rel} in {model_dir} is a symlink to {target}, outside the model "
                        f"root {real_root}; refusing to load it")
                if not os.path.exists(target):
                    raise SourceError("InvalidSource",
                                      f"{rel} in {model_dir} is a dangling symlink")
            elif not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                raise SourceError("InvalidSource",
                                  f"{rel} in {model_dir} is not a regular file or directory")
    check_config(Path(model_dir))
