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

The state file's modification time is the download's *last use* (touched whenever a fetch
returns the directory). :func:`cache_bytes` measures the cache; :func:`collect_garbage` applies
:func:`~node_agent.fetch.gc.gc_plan`: it takes each entry's lock without waiting (an entry whose
lock is held is *active*: a download runs, so it is never touched) and holds the locks it got
while it deletes, so no download starts in a directory being deleted. Agents sharing one cache
(a development host) keep each other's sources: each holds a shared ``flock`` on
``<dir>.inuse`` for every source assigned to it or loaded (:class:`SourceHolds`), and the
collector counts an entry it cannot lock exclusively there as active too.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import shutil
import stat
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

from ..model_dir import SourceError
from .bounds import DownloadLimits, hub_digest, is_commit, manifest_digest, room_refusal
from .gc import CacheEntry, Deletion, PartFile, gc_plan
from .manifest import STATE_FILE, _safe_relpath

log = logging.getLogger("node_agent.fetch")

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


#: ``make_room(need, shortfall)``: free space before a download of ``need`` more bytes for
#: which the disk lacks ``shortfall`` bytes (the agent's cache garbage collector).
MakeRoom = Callable[[int, int], Awaitable[None]]


async def ensure_room(need: int, *, where: Path, limits: DownloadLimits,
                      disk_usage: Callable[[str], Any], make_room: MakeRoom | None, what: str,
                      model_cache: Path | None = None) -> None:
    """Before a download's first byte: :func:`~node_agent.fetch.bounds.room_refusal` of
    ``need`` bytes on ``where``'s disk (``disk_usage``, ``shutil.disk_usage``'s shape) and,
    when ``model_cache`` is given and ``limits`` has a cap, against the cap over
    :func:`cache_bytes`; ``make_room`` is asked once to free what is missing, then the check
    is made again. ``what`` names the source. Raises ``InsufficientDisk``."""
    if model_cache is None:  # the cap is the model cache's (not the Hugging Face cache's)
        limits = dataclasses.replace(limits, cache_max_bytes=0)

    def measure() -> tuple[SourceError | None, int]:
        usage = disk_usage(str(where))
        held = cache_bytes(model_cache) if model_cache is not None and limits.cache_max_bytes else 0
        refusal = room_refusal(need, free=usage.free, fs_total=usage.total, cache_bytes=held,
                               limits=limits, what=what)
        return refusal, max(need - (usage.free - limits.reserve(usage.total)), 0)

    refusal, shortfall = await asyncio.to_thread(measure)
    if refusal is not None and make_room is not None:
        await make_room(need, shortfall)
        refusal, _ = await asyncio.to_thread(measure)
    if refusal is not None:
        raise refusal


def touch_state(target: Path) -> None:
    """Mark ``target``'s download as used now (its state file's mtime: the garbage collector's
    least-recently-used order). Errors are ignored."""
    with contextlib.suppress(OSError):
        os.utime(target / STATE_FILE)


def digest_of(model_dir: Path) -> str:
    """The content address of a fetched model directory: a mirror download's
    :func:`~node_agent.fetch.bounds.manifest_digest` (from its state file), a Hugging Face
    snapshot's ``hf-commit:<commit>`` (``…/snapshots/<commit>``), else ``""`` (a local
    directory: not content-addressed)."""
    state = _load_state(model_dir)
    if state is not None:
        digest = state.get("digest")
        if isinstance(digest, str) and digest:
            return digest
        files = state.get("files")
        pairs = [(f.get("path"), f.get("sha256")) for f in files if isinstance(f, dict)] if (
            isinstance(files, list)) else []
        if not pairs or not all(isinstance(p, str) and isinstance(d, str) for p, d in pairs):
            return ""  # a download from before digests were required
        return manifest_digest(pairs)  # type: ignore[arg-type]
    if model_dir.parent.name == "snapshots" and is_commit(model_dir.name):
        return hub_digest(model_dir.name)
    return ""


def _tree(directory: Path) -> tuple[int, list[PartFile]]:
    """Bytes of the regular files under ``directory`` (symlinks not followed) and its
    ``.part`` files."""
    total = 0
    parts: list[PartFile] = []
    for dirpath, _, filenames in os.walk(directory):
        for name in filenames:
            path = os.path.join(dirpath, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            total += st.st_size
            if name.endswith(".part"):
                parts.append(PartFile(os.path.relpath(path, directory), st.st_size, st.st_mtime))
    return total, parts


def cache_bytes(root: Path) -> int:
    """Bytes of the downloads in the model cache ``root`` (its ``https/`` directories, what the
    cap and the garbage collector govern; 0 when there are none)."""
    base = Path(root) / "https"
    return _tree(base)[0] if base.is_dir() else 0


#: Suffix of the file whose shared lock marks a download in use by an agent.
IN_USE_SUFFIX = ".inuse"


class SourceHolds:
    """Shared locks (``flock(LOCK_SH)``) on ``root/https/<name>.inuse`` for the downloads this
    agent has assigned or loaded, so that another agent's :func:`collect_garbage` on the same
    cache leaves them alone. :meth:`hold` makes the held set ``names`` (a name whose lock a
    collector holds right now is tried again on the next call); :meth:`close` drops them all.
    Not thread-safe: call it from one thread (the event loop)."""

    def __init__(self, root: Path) -> None:
        self._base = Path(root) / "https"
        self._fds: dict[str, int] = {}

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._fds)

    def hold(self, names: Iterable[str]) -> None:
        want = set(names)
        for name in [n for n in self._fds if n not in want]:
            os.close(self._fds.pop(name))
        for name in sorted(want - set(self._fds)):
            try:
                self._base.mkdir(parents=True, exist_ok=True)
                fd = os.open(self._base / f"{name}{IN_USE_SUFFIX}", os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                log.warning("model cache: cannot mark %s in use: %s", name, e)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:  # a collector holds it this instant: next time
                os.close(fd)
                continue
            self._fds[name] = fd

    def close(self) -> None:
        self.hold(())


def _in_use_elsewhere(base: Path, name: str, fds: list[int]) -> bool:
    """True when another agent holds ``name``'s in-use lock; else its exclusive lock is taken
    (its fd appended to ``fds``, closed by the caller) until the collection ends."""
    try:
        fd = os.open(base / f"{name}{IN_USE_SUFFIX}", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return True
    fds.append(fd)
    return False


def collect_garbage(root: Path, *, assigned: Iterable[str], loaded: Iterable[str],
                    limits: DownloadLimits, now: float, need: int = 0,
                    shortfall: int = 0) -> list[Deletion]:
    """Delete what :func:`~node_agent.fetch.gc.gc_plan` names among the ``https://`` downloads
    in ``root/https/`` and return it. ``assigned`` / ``loaded``: their directory names
    (:func:`~node_agent.fetch.manifest.mirror_dir`); ``now``: unix seconds; ``need`` /
    ``shortfall``: bytes a download is about to add / the disk lacks for it. Blocking (run it
    in a thread). An ``OSError`` while deleting one entry is logged and the rest goes on."""
    from filelock import FileLock, Timeout

    base = root / "https"
    if not base.is_dir():
        return []
    assigned, loaded = set(assigned), set(loaded)
    held: list[Any] = []
    in_use_fds: list[int] = []
    entries: list[CacheEntry] = []
    try:
        for d in sorted(base.iterdir()):
            if d.is_symlink() or not d.is_dir():
                continue
            lock = FileLock(f"{d}.lock")
            try:
                lock.acquire(timeout=0)
                held.append(lock)
                active = False
            except Timeout:
                active = True  # a download holds it
            if (not active and d.name not in assigned and d.name not in loaded
                    and _in_use_elsewhere(base, d.name, in_use_fds)):
                active = True  # another agent sharing this cache has it assigned
            size, parts = _tree(d)
            try:
                used = (d / STATE_FILE).stat().st_mtime
            except OSError:
                used = d.stat().st_mtime
            entries.append(CacheEntry(d.name, size, used, active, tuple(parts)))
        plan = gc_plan(entries, assigned, loaded, now, limits.cache_max_bytes, need=need,
                       shortfall=shortfall, unused_max_age_s=limits.unused_max_age_s,
                       part_max_age_s=limits.part_max_age_s)
        done: list[Deletion] = []
        for x in plan:
            try:
                if x.part is not None:
                    (base / x.name / x.part).unlink()
                else:
                    shutil.rmtree(base / x.name)
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("model cache: cannot delete %s: %s", base / x.name, e)
                continue
            log.info("model cache: deleted %s (%s, %d bytes)",
                     x.name + (f"/{x.part}" if x.part else ""), x.reason, x.bytes)
            done.append(x)
        return done
    finally:
        for lock in held:
            lock.release()
        for fd in in_use_fds:
            os.close(fd)
