"""The download cache on disk: where downloads go, the download state file, and the lock.

:func:`default_model_cache` is ``$MLX_FLEET_CACHE/models``. An ``https://`` mirror's directory
(:func:`~node_agent.fetch.manifest.mirror_dir`) holds the model files, ``<path>.part`` files
while they download, and :data:`~node_agent.fetch.manifest.STATE_FILE`: the manifest as
fetched plus ``complete`` (written atomically: temporary file, fsync, rename). A directory is
adopted without contacting the server when its state file names the same base URL, is marked
complete and every file has its recorded size (:func:`_complete_download`). ``<dir>.lock``
(``filelock``, polled every 0.1 s so that waiting stays cancellable) serializes fetches of
one URI across tasks and processes. Read errors make a state file count as absent; write
errors (``OSError``) propagate.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from ..model_dir import SourceError
from .manifest import STATE_FILE, _safe_relpath

_CHUNK_BYTES = 1 << 20


def default_model_cache() -> Path:
    """Where downloads go by default: ``$MLX_FLEET_CACHE/models`` (``MLX_FLEET_CACHE`` defaults
    to ``~/.cache/mlx-fleet``)."""
    root = os.environ.get("MLX_FLEET_CACHE") or Path.home() / ".cache" / "mlx-fleet"
    return Path(root) / "models"


def _load_state(target: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((target / STATE_FILE).read_bytes())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(json.dumps(data, indent=1).encode())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _complete_download(target: Path, base: str) -> bool:
    """True when ``target`` holds a download of ``base`` marked complete whose files are all
    present with their recorded sizes."""
    state = _load_state(target)
    if not state or state.get("uri") != base or state.get("complete") is not True:
        return False
    try:
        for item in state["files"]:
            path = _safe_relpath(item["path"], STATE_FILE)
            if (target / path).stat().st_size != item["size"]:
                return False
    except (KeyError, TypeError, OSError, SourceError):
        return False
    return True


def _hash_file(path: Path) -> tuple[Any, int]:
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        while block := f.read(_CHUNK_BYTES):
            h.update(block)
            n += len(block)
    return h, n


@contextlib.asynccontextmanager
async def _dir_lock(path: Path) -> AsyncIterator[None]:
    """An exclusive file lock at ``path``, polled so that waiting stays cancellable."""
    from filelock import FileLock, Timeout

    lock = FileLock(str(path))
    while True:
        try:
            lock.acquire(timeout=0)
            break
        except Timeout:
            await asyncio.sleep(0.1)
    try:
        yield
    finally:
        lock.release()
