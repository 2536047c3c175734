"""Resolve an assignment's model source URI to a local model directory.

Accepted today: ``file:///abs/path`` and a bare absolute path ``/abs/path``; the directory must
exist and hold an mlx-lm model (at least ``config.json``). ``hf://`` and ``https://`` sources are
recognised and refused with reason ``UnsupportedSource``: downloading (resumable, verified,
with progress) arrives with the lifecycle work.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlparse

__all__ = ["SourceError", "resolve_source"]


class SourceError(Exception):
    """A model source can't be used. ``reason``: CamelCase machine reason (``ModelNotFound``,
    ``UnsupportedSource``, ``InvalidSource``); ``message``: human-readable detail."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


def resolve_source(uri: str) -> Path:
    """``uri`` → absolute local path of the model directory.

    Raises :class:`SourceError`: ``UnsupportedSource`` for ``hf://``/``https://``/``http://``
    and unknown schemes, ``InvalidSource`` for a relative path or a ``file://`` URI with a host,
    ``ModelNotFound`` when the directory or its ``config.json`` is missing.
    Touches the file system (a few ``stat`` calls); cheap, but call it off the loop for slow disks.
    """
    raw = (uri or "").strip()
    if not raw:
        raise SourceError("InvalidSource", "the model source URI is empty")
    parsed = urlparse(raw)
    scheme = parsed.scheme.lower()
    if scheme in {"hf", "https", "http"}:
        raise SourceError("UnsupportedSource",
                          f"{scheme}:// sources are not supported yet ({raw}); downloading "
                          "arrives with the lifecycle work — use file:///abs/path")
    if scheme == "file":
        if parsed.netloc not in {"", "localhost"}:
            raise SourceError("InvalidSource",
                              f"file URI with a remote host {parsed.netloc!r}: {raw}")
        path = Path(unquote(parsed.path))
    elif scheme == "":
        path = Path(raw)
    else:
        raise SourceError("UnsupportedSource", f"unknown source scheme {scheme!r} in {raw}")
    if not path.is_absolute():
        raise SourceError("InvalidSource", f"model path must be absolute, got {raw!r}")
    if not path.is_dir():
        raise SourceError("ModelNotFound", f"no model directory at {path}")
    if not (path / "config.json").is_file():
        raise SourceError("ModelNotFound", f"{path} holds no config.json (not an mlx-lm model)")
    return path
