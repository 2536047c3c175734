"""Resolve an assignment's model source URI to a local model directory, and check that directory.

Accepted sources:

* ``file:///abs/path`` (or ``file://localhost/abs/path``) and a bare absolute path ``/abs/path``:
  a model directory on this Mac;
* ``hf://<org>/<repo>[@<revision>]``: a Hugging Face Hub repository, through huggingface_hub and
  its cache (see :mod:`node_agent.fetch.hub`);
* ``https://host/path/``: a mirror directory holding a ``manifest.json`` (format in
  :mod:`node_agent.fetch.manifest`), downloaded into the agent's model cache.

``http://`` is refused: weights fetched over plain HTTP can be swapped by anyone on the path.

Every source is checked against the fleet's source policy (:mod:`mlx_fleet.source_policy`,
the agent's ``--source-policy``) before anything is looked at: a local directory only under
the policy's ``fileRoots`` (none by default), checked again after resolving symlinks (the
resolved path under a resolved root), before the file system is asked whether it exists.

Whatever the source, the directory is checked before anything is loaded from it
(:func:`node_agent.model_dir.check_model_dir`, which also defines :class:`SourceError`): it must hold a ``config.json`` that is a JSON object and asks for no
custom model code (``trust_remote_code`` is never enabled), and no entry in it may be a symlink
that leads out of the model's root, nor a device, FIFO or socket. A local path must not contain
``..`` segments.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from mlx_fleet.source_policy import (DEFAULT_POLICY, SOURCE_REFUSED, SourcePolicy,
                                     check_file_path, check_source)

from .model_dir import SourceError, check_model_dir

if TYPE_CHECKING:
    from mlx_fleet.contract import DownloadProgress

__all__ = ["resolve_source", "is_remote", "REMOTE_SCHEMES"]

#: Schemes served by :mod:`node_agent.fetch` (a download into a local cache).
REMOTE_SCHEMES = frozenset({"hf", "https"})
def _scheme(raw: str) -> str:
    return urlparse(raw).scheme.lower()


def is_remote(uri: str) -> bool:
    """True for sources that are downloaded first (``hf://``, ``https://``)."""
    return _scheme((uri or "").strip()) in REMOTE_SCHEMES


def resolve_source(uri: str, *, dest_root: str | os.PathLike | None = None,
                   progress: Callable[[DownloadProgress], None] | None = None,
                   policy: SourcePolicy = DEFAULT_POLICY, **fetch_options: Any) -> Path:
    """``uri`` → absolute local path of a checked model directory.

    Local sources (``file://``, ``/abs``) are only checked (a few ``stat`` calls and a walk of the
    directory). Remote ones are downloaded with :func:`node_agent.fetch.fetch` into
    ``dest_root`` (default :func:`node_agent.fetch.default_model_cache`), reporting to
    ``progress``; ``fetch_options`` go to ``fetch`` (``stall_timeout_s`` ...). That blocks for
    the whole download: call it from a thread, never on a running event loop (use ``fetch``
    there), or it raises ``RuntimeError``.

    ``policy``: the fleet's source policy (default the secure
    :data:`~mlx_fleet.source_policy.DEFAULT_POLICY`, which allows no local directory).

    Raises :class:`SourceError`: ``SourceRefused`` when ``policy`` refuses the source or its
    resolved path; ``UnsupportedSource`` for ``http://`` and unknown schemes;
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
        return asyncio.run(fetch(raw, root, progress=progress, policy=policy, **fetch_options))
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
    refusal = (check_source(policy, str(path))  # the scheme, the roots as written
               or check_file_path(policy, os.path.realpath(path),  # then symlinks resolved
                                  [os.path.realpath(r) for r in policy.file_roots]))
    if refusal is not None:
        raise SourceError(SOURCE_REFUSED, refusal.message)
    if not path.is_dir():
        raise SourceError("ModelNotFound", f"no model directory at {path}")
    check_model_dir(path)
    return path
