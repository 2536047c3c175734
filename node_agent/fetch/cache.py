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

The agent's own Hugging Face cache is ``<root>/hf`` (:func:`hub_cache_dir`, unless
``$HF_HUB_CACHE`` names another: a cache shared with other tools is neither capped nor
collected). Its bytes count in :func:`cache_bytes` (the cap), and :func:`collect_garbage`
deletes its unprotected ``models--*/snapshots/<commit>`` revisions with huggingface_hub's
own ``scan_cache_dir(...).delete_revisions(...)`` (blobs no kept revision links to go with
them); a revision's last use is its snapshot directory's modification time, touched
whenever a fetch returns it. Its in-use locks are ``<root>/hf-inuse/<name>.inuse``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
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
from .manifest import STATE_FILE, _safe_relpath, mirror_dir, parse_hf_uri

log = logging.getLogger("node_agent.fetch")

_CHUNK_BYTES = 1 << 20


def default_model_cache() -> Path:
    """Where downloads go by default: ``$MLX_FLEET_CACHE/models`` (``MLX_FLEET_CACHE`` defaults
    to ``~/.cache/mlx-fleet``)."""
    root = os.environ.get("MLX_FLEET_CACHE") or Path.home() / ".cache" / "mlx-fleet"
    return Path(root) / "models"


#: The agent's own Hugging Face cache, inside the model cache (capped and collected).
HUB_CACHE_DIR = "hf"
#: Prefix of the garbage collector's names of Hugging Face cache entries (never in a
#: mirror's directory name).
HUB_ENTRY_PREFIX = "hf@"
#: Where the in-use locks of Hugging Face cache entries are (beside the cache).
_HUB_INUSE_DIR = "hf-inuse"


def hub_cache_dir(model_cache: Path) -> Path:
    """The Hugging Face cache the agent downloads ``hf://`` sources into:
    ``$HF_HUB_CACHE`` when set (read now), else its own ``model_cache/hf``."""
    env = os.environ.get("HF_HUB_CACHE")
    return Path(env) if env else Path(model_cache) / HUB_CACHE_DIR


def owns_hub_cache(model_cache: Path, hub_cache: str | os.PathLike | None) -> bool:
    """True when ``hub_cache`` is the agent's own (``model_cache/hf``): counted under the cap
    and garbage-collected."""
    return hub_cache is not None and (
        os.path.abspath(hub_cache) == os.path.abspath(Path(model_cache) / HUB_CACHE_DIR))


def _repo_folder(repo_id: str) -> str:
    return "models--" + repo_id.replace("/", "--")


def cache_entry_name(uri: str, model_cache: Path) -> tuple[str, Path | None] | None:
    """The garbage collector's name of a remote source's cache entry and the path whose
    modification time is its last use: an ``https://`` mirror's directory name and its state
    file; a pinned ``hf://org/repo@<commit>``'s ``hf@models--org--repo@<commit>`` and its
    snapshot directory in ``model_cache/hf``; an unpinned ``hf://`` source's group
    ``hf@models--org--repo`` (every revision kept) and None. None for another or a malformed
    source."""
    scheme = uri.strip().partition("://")[0].lower()
    try:
        if scheme == "https":
            d = mirror_dir(uri, model_cache)
            return d.name, d / STATE_FILE
        if scheme == "hf":
            repo_id, revision = parse_hf_uri(uri)
            group = HUB_ENTRY_PREFIX + _repo_folder(repo_id)
            if is_commit(revision):
                snapshot = (Path(model_cache) / HUB_CACHE_DIR / _repo_folder(repo_id)
                            / "snapshots" / str(revision))
                return f"{group}@{revision}", snapshot
            return group, None
    except SourceError:
        return None
    return None


def touch_entry(path: Path | None) -> None:
    """Mark a cache entry used now (the modification time of :func:`cache_entry_name`'s
    path). Errors are ignored."""
    if path is not None:
        with contextlib.suppress(OSError):
            os.utime(path)


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
    """Bytes of the downloads in the model cache ``root`` (its ``https/`` directories and its
    own Hugging Face cache ``hf/``, what the cap and the garbage collector govern; 0 when
    there are none)."""
    return sum(_tree(base)[0] for base in (Path(root) / "https", Path(root) / HUB_CACHE_DIR)
               if base.is_dir())


def _inuse_path(root: Path, name: str) -> Path:
    if name.startswith(HUB_ENTRY_PREFIX):
        return Path(root) / _HUB_INUSE_DIR / f"{name}{IN_USE_SUFFIX}"
    return Path(root) / "https" / f"{name}{IN_USE_SUFFIX}"


#: Suffix of the file whose shared lock marks a download in use by an agent.
IN_USE_SUFFIX = ".inuse"


class SourceHolds:
    """Shared locks (``flock(LOCK_SH)``) on ``root/https/<name>.inuse`` (``root/hf-inuse/`` for
    a Hugging Face entry or group) for the downloads this agent has assigned or loaded, so
    that another agent's :func:`collect_garbage` on the same cache leaves them alone.
    :meth:`hold` makes the held set ``names`` (a name whose lock a collector holds right now is
    tried again on the next call); :meth:`close` drops them all. Not thread-safe: call it from
    one thread (the event loop)."""

    def __init__(self, root: Path) -> None:
        self._root = Path(root)
        self._fds: dict[str, int] = {}

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._fds)

    def hold(self, names: Iterable[str]) -> None:
        want = set(names)
        for name in [n for n in self._fds if n not in want]:
            os.close(self._fds.pop(name))
        for name in sorted(want - set(self._fds)):
            path = _inuse_path(self._root, name)
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
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


def _in_use_elsewhere(root: Path, name: str, fds: list[int]) -> bool:
    """True when another agent holds ``name``'s in-use lock; else its exclusive lock is taken
    (its fd appended to ``fds``, closed by the caller) until the collection ends."""
    path = _inuse_path(root, name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return True
    fds.append(fd)
    return False


def _hub_entries(hub: Path, keep: set[str], fds: list[int]) -> tuple[list[CacheEntry], dict]:
    """The revisions of the Hugging Face cache ``hub`` as garbage-collector entries (model
    repositories only; unreadable ones skipped, as ``scan_cache_dir`` reports them), and each
    entry's ``(HFCacheInfo limited to its repository, commit)`` to delete it with."""
    from collections import Counter

    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(hub)
    for warning in info.warnings:
        log.warning("model cache: %s", warning)
    entries: list[CacheEntry] = []
    targets: dict[str, tuple[Any, str]] = {}
    for repo in info.repos:
        if repo.repo_type != "model":
            continue
        group = HUB_ENTRY_PREFIX + repo.repo_path.name
        blobs = {r.commit_hash: {f.blob_path: f.size_on_disk for f in r.files}
                 for r in repo.revisions}
        shared = Counter(b for files in blobs.values() for b in files)
        only_repo = dataclasses.replace(info, repos=frozenset({repo}))
        for r in repo.revisions:
            name = f"{group}@{r.commit_hash}"
            own = sum(n for b, n in blobs[r.commit_hash].items() if shared[b] == 1)
            try:
                used = r.snapshot_path.stat().st_mtime
            except OSError:
                used = 0.0
            active = name not in keep and group not in keep and (
                _in_use_elsewhere(hub.parent, name, fds)
                or _in_use_elsewhere(hub.parent, group, fds))
            entries.append(CacheEntry(name, own, used, active, group=group))
            targets[name] = (only_repo, r.commit_hash)
    return entries, targets


def collect_garbage(root: Path, *, assigned: Iterable[str], loaded: Iterable[str],
                    limits: DownloadLimits, now: float, need: int = 0,
                    shortfall: int = 0) -> list[Deletion]:
    """Delete what :func:`~node_agent.fetch.gc.gc_plan` names among the ``https://`` downloads
    in ``root/https/`` and the revisions in the agent's own Hugging Face cache ``root/hf/``,
    and return it. ``assigned`` / ``loaded``: their names (:func:`cache_entry_name`);
    ``now``: unix seconds; ``need`` / ``shortfall``: bytes a download is about to add / the
    disk lacks for it. Blocking (run it in a thread). An ``OSError`` while deleting one entry
    is logged and the rest goes on."""
    from filelock import FileLock, Timeout

    base = root / "https"
    hub = root / HUB_CACHE_DIR
    assigned, loaded = set(assigned), set(loaded)
    held: list[Any] = []
    in_use_fds: list[int] = []
    entries: list[CacheEntry] = []
    targets: dict[str, tuple[Any, str]] = {}
    try:
        for d in sorted(base.iterdir()) if base.is_dir() else ():
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
                    and _in_use_elsewhere(root, d.name, in_use_fds)):
                active = True  # another agent sharing this cache has it assigned
            size, parts = _tree(d)
            try:
                used = (d / STATE_FILE).stat().st_mtime
            except OSError:
                used = d.stat().st_mtime
            entries.append(CacheEntry(d.name, size, used, active, tuple(parts)))
        if hub.is_dir() and not hub.is_symlink():
            try:
                found, targets = _hub_entries(hub, assigned | loaded, in_use_fds)
                entries += found
            except Exception as e:  # noqa: BLE001 - the https:// downloads are still collected
                log.warning("model cache: cannot scan the Hugging Face cache %s: %s", hub, e)
        plan = gc_plan(entries, assigned, loaded, now, limits.cache_max_bytes, need=need,
                       shortfall=shortfall, unused_max_age_s=limits.unused_max_age_s,
                       part_max_age_s=limits.part_max_age_s)
        done: list[Deletion] = []
        for x in plan:
            try:
                if x.name in targets:
                    info, commit = targets[x.name]
                    info.delete_revisions(commit).execute()
                elif x.part is not None:
                    (base / x.name / x.part).unlink()
                else:
                    shutil.rmtree(base / x.name)
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("model cache: cannot delete %s: %s", x.name, e)
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
