"""Download a remote model source into a local model directory, with progress.

:func:`fetch` resolves ``hf://`` and ``https://`` sources (local ones are
:func:`node_agent.sources.resolve_source`'s) and returns the local directory, checked by
:func:`node_agent.model_dir.check_model_dir` (no symlink out of the model, a ``config.json``
object, no custom code).

``hf://<org>/<repo>[@<revision>]``
    A Hugging Face Hub repository, through ``huggingface_hub.snapshot_download`` and its cache
    (``blobs/``, ``snapshots/<commit>/``, ``refs/<branch-or-tag>``; directory ``hf_cache_dir``,
    else ``$HF_HUB_CACHE``, else huggingface_hub's default ``~/.cache/huggingface/hub``), so
    models already cached by ``mlx_lm`` or ``hf download`` are reused. ``revision``: a branch,
    tag or commit hash (default ``main``); the assignment's ``source.revision`` is a label and is
    not used. Offline mode (``HF_HUB_OFFLINE=1`` at call time, or ``offline=True``) reads the
    cache only (``local_files_only``). Only the files mlx-lm loads are fetched
    (:data:`HUB_ALLOW_PATTERNS`; no ``*.py``). Timeouts, retries and resumption are
    huggingface_hub's; progress comes from its progress bars (best effort).

``https://host/path/`` (a mirror)
    A directory served over HTTPS holding ``manifest.json`` (the URI may also name the manifest
    itself: ``https://host/path/manifest.json``). Format, UTF-8 JSON::

        {"files": [{"path": "config.json", "size": 454, "sha256": "<64 hex>"},
                   {"path": "model.safetensors", "size": 593251, "sha256": "<64 hex>"}]}

    ``path``: relative, ``/``-separated, no ``.``/``..``/empty segment, no backslash; it must
    list ``config.json``. ``size`` (bytes) and ``sha256`` (hex) are optional but checked when
    given (without ``size`` the ``Content-Length`` is checked). Each file is fetched from
    ``<base>/<path>`` (percent-encoded) into ``dest_root/https/<name>/`` where ``<name>`` is
    the host, port and path made file-name safe plus 16 hex digits of the URI's SHA-256. A file
    is written to ``<path>.part``, resumed with ``Range: bytes=<done>-`` after a dropped
    connection (up to ``max_attempts`` tries without progress) and on the next call after a
    failure, checked, then renamed into place. ``config.json`` comes first and is checked
    before any weights are fetched. The manifest is kept as ``.mlx-fleet-download.json``;
    once every file is verified it is marked complete, and later calls (an agent restart)
    adopt the directory without contacting the server (files are checked by size). A mirror
    path should therefore be immutable (one path per model version); if the manifest changes
    while a download is incomplete, files whose entry changed are fetched again.
    Certificates are checked against the system trust store (``SSL_CERT_FILE`` /
    ``SSL_CERT_DIR`` at call time name a private CA) or ``ssl_context``; a redirect to
    plain ``http://`` is refused, and so are credentials and queries in the URI (they would be
    copied into reports). A file lock (``<dir>.lock``) serializes fetches of one URI across
    tasks and processes.

Progress: :class:`~mlx_fleet.contract.DownloadProgress` passed to ``progress`` at most every
``progress_interval_s`` (and once at the end, complete): ``bytes_done`` counts bytes on disk
(resumed ones included), ``rate_bytes_per_second`` the bytes received over the last
:data:`RATE_WINDOW_S` seconds, ``eta_seconds`` remaining ÷ rate. The callback runs on the
event loop; an exception from it is logged and ignored.

Failures raise :class:`~node_agent.model_dir.SourceError`: ``ModelNotFound`` (no such repository
or revision, not cached while offline, no manifest at the mirror), ``InvalidSource`` (malformed
URI or manifest, unsafe path, bad model directory), ``DownloadFailed`` (an HTTP error status,
the connection lost too often, TLS failure, hub unreachable), ``DownloadStalled`` (no byte for
``stall_timeout_s``; names the file and the bytes done), ``DownloadCorrupt`` (size or sha256
mismatch; the bad file is deleted). Partial files are kept, so calling again resumes.
Cancelling the awaiting task stops an ``https://`` download at once (between chunks); an
``hf://`` download runs on in its thread until huggingface_hub finishes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp

from mlx_fleet.contract import DownloadProgress

from .model_dir import SourceError, check_config, check_model_dir

log = logging.getLogger(__name__)

__all__ = ["fetch", "default_model_cache", "parse_hf_uri", "mirror_base_url", "mirror_dir",
           "parse_manifest", "ManifestEntry", "ProgressCallback", "MANIFEST_NAME", "STATE_FILE",
           "HUB_ALLOW_PATTERNS", "DEFAULT_STALL_TIMEOUT_S", "PROGRESS_INTERVAL_S",
           "RATE_WINDOW_S"]

ProgressCallback = Callable[[DownloadProgress], None]

#: The mirror's file list, next to the model files.
MANIFEST_NAME = "manifest.json"
#: The manifest as fetched, plus ``complete``, kept in the download directory.
STATE_FILE = ".mlx-fleet-download.json"
#: Seconds without a byte before a download fails with ``DownloadStalled``.
DEFAULT_STALL_TIMEOUT_S = 60.0
#: Least interval between two progress callbacks (seconds).
PROGRESS_INTERVAL_S = 0.5
#: The transfer rate is averaged over this many seconds.
RATE_WINDOW_S = 5.0
#: Files of a hub repository that are fetched (what mlx-lm loads; never ``*.py``).
HUB_ALLOW_PATTERNS = ("*.json", "model*.safetensors", "tokenizer.model", "*.tiktoken",
                      "tiktoken.model", "*.txt", "*.jsonl", "*.jinja")
_MAX_MANIFEST_BYTES = 4 * 2**20
_CHUNK_BYTES = 1 << 20
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")
_HUB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_HUB_REVISION = re.compile(r"^[A-Za-z0-9._][A-Za-z0-9._/-]{0,254}$")


def default_model_cache() -> Path:
    """Where downloads go by default: ``$MLX_FLEET_CACHE/models`` (``MLX_FLEET_CACHE`` defaults
    to ``~/.cache/mlx-fleet``)."""
    root = os.environ.get("MLX_FLEET_CACHE") or Path.home() / ".cache" / "mlx-fleet"
    return Path(root) / "models"


def _ignore(_: DownloadProgress) -> None:
    pass


# ---------------------------------------------------------------------------------------------
# URIs and the manifest
# ---------------------------------------------------------------------------------------------


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
    ``sha256`` (lower-case hex) when the manifest gives them."""

    path: str
    size: int | None = None
    sha256: str | None = None

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
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
            raise SourceError("InvalidSource", f"{where}: 'size' must be a non-negative integer")
        digest = item.get("sha256")
        if digest is not None and (not isinstance(digest, str) or not _HEX64.match(digest)):
            raise SourceError("InvalidSource", f"{where}: 'sha256' must be 64 hex digits")
        if path in seen:
            raise SourceError("InvalidSource", f"{where}: {path!r} is listed twice")
        seen.add(path)
        entries.append(ManifestEntry(path, size, digest.lower() if digest else None))
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


# ---------------------------------------------------------------------------------------------
# progress
# ---------------------------------------------------------------------------------------------


class _Progress:
    """Counts bytes and files, measures the rate, and calls the callback at a bounded rate."""

    def __init__(self, callback: ProgressCallback, interval: float) -> None:
        self._callback = callback
        self._interval = interval
        self._last_emit: float | None = None
        self.expected: dict[str, int | None] = {}   # path → size (None: unknown yet)
        self.local: dict[str, int] = {}             # path → bytes on disk
        self.done: set[str] = set()
        self.wire = 0                               # bytes received by this call
        self._samples: deque[tuple[float, int]] = deque([(time.monotonic(), 0)])
        # (hub) values that override the per-file accounting
        self.override: tuple[int, int, int, int] | None = None

    def received(self, path: str, n: int) -> None:
        self.local[path] = self.local.get(path, 0) + n
        self.wire += n
        now = time.monotonic()
        if now - self._samples[-1][0] >= 0.1:
            self._samples.append((now, self.wire))
        self.maybe_emit()

    def set_wire(self, n: int) -> None:
        """Set the bytes received so far (for sources that count them elsewhere)."""
        self.wire = n
        self._samples.append((time.monotonic(), n))
        self.maybe_emit()

    def rate(self, now: float) -> float:
        window_start = now - RATE_WINDOW_S
        while len(self._samples) > 1 and self._samples[1][0] <= window_start:
            self._samples.popleft()
        t0, w0 = self._samples[0]
        if now - t0 < 1e-3 or self.wire <= w0:
            return 0.0
        return (self.wire - w0) / (now - t0)

    def snapshot(self) -> DownloadProgress:
        now = time.monotonic()
        if self.override is not None:
            done, total, files_done, files_total = self.override
        else:
            sizes = list(self.expected.values())
            total = sum(sizes) if sizes and None not in sizes else 0  # type: ignore[arg-type]
            done = sum(self.local.values())
            files_done, files_total = len(self.done), len(self.expected)
        rate = self.rate(now)
        eta = max(total - done, 0) / rate if rate > 0 and total > 0 else None
        return DownloadProgress(bytes_done=max(done, 0), bytes_total=max(total, 0),
                                rate_bytes_per_second=rate, eta_seconds=eta,
                                files_done=files_done, files_total=files_total)

    def maybe_emit(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and self._last_emit is not None and now - self._last_emit < self._interval:
            return
        self._last_emit = now
        try:
            self._callback(self.snapshot())
        except Exception:  # noqa: BLE001 - a reporting bug must not fail the download
            log.exception("download progress callback failed")


# ---------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------


async def fetch(uri: str, dest_root: str | os.PathLike, *,
                progress: ProgressCallback | None = None,
                stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
                progress_interval_s: float = PROGRESS_INTERVAL_S,
                max_attempts: int = 5,
                chunk_bytes: int = _CHUNK_BYTES,
                ssl_context: ssl.SSLContext | None = None,
                hf_cache_dir: str | os.PathLike | None = None,
                hf_endpoint: str | None = None,
                offline: bool | None = None) -> Path:
    """Download ``uri`` (``hf://`` or ``https://``) unless it is already complete on disk, and
    return the checked local model directory.

    ``dest_root``: where ``https://`` mirrors are stored (``dest_root/https/<name>/``);
    ``progress``: receives :class:`DownloadProgress` at most every ``progress_interval_s``
    seconds and once at the end (see the module docstring); ``stall_timeout_s``: seconds
    without a byte (or without an answer) before ``DownloadStalled``; ``max_attempts``:
    connection losses per file, in a row without progress, before ``DownloadFailed``;
    ``chunk_bytes``: bytes hashed and written per disk write; ``ssl_context``: certificate
    checks (default: the system trust store, honouring ``SSL_CERT_FILE``/``SSL_CERT_DIR``).
    ``hf_cache_dir``/``hf_endpoint``/``offline``: the Hugging Face cache, Hub URL (a Hub
    mirror) and offline mode (defaults: ``$HF_HUB_CACHE``, ``$HF_ENDPOINT``, ``$HF_HUB_OFFLINE``
    read at call time, else huggingface_hub's own).

    Raises :class:`~node_agent.model_dir.SourceError` (reasons in the module docstring);
    ``UnsupportedSource`` for another scheme."""
    callback = progress or _ignore
    scheme = urlsplit(uri.strip()).scheme.lower()
    if scheme == "hf":
        return await _fetch_hub(uri, callback=callback, interval=progress_interval_s,
                                stall_timeout_s=stall_timeout_s, cache_dir=hf_cache_dir,
                                endpoint=hf_endpoint, offline=offline)
    if scheme == "https":
        return await _Mirror(uri, Path(dest_root), callback=callback,
                             interval=progress_interval_s, stall_timeout_s=stall_timeout_s,
                             max_attempts=max(1, max_attempts), chunk_bytes=max(1, chunk_bytes),
                             ssl_context=ssl_context).run()
    raise SourceError("UnsupportedSource", f"cannot fetch {scheme or 'a local'}:// source {uri!r}")


# ---------------------------------------------------------------------------------------------
# hf://
# ---------------------------------------------------------------------------------------------


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _hub_offline(offline: bool | None) -> bool:
    if offline is not None:
        return offline
    if _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE"):
        return True
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _hub_bar_class(bars: list[Any]) -> type:
    """A tqdm class that records huggingface_hub's progress bars (n, total, unit) and renders
    nothing."""
    from tqdm.auto import tqdm

    class _Bar(tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.pop("name", None)
            kwargs["disable"] = False
            kwargs["file"] = _NullWriter()
            kwargs["mininterval"] = 3600.0
            super().__init__(*args, **kwargs)
            bars.append(self)

    return _Bar


class _NullWriter:
    """A text sink for the recording progress bars."""

    def write(self, _: str) -> int:
        return 0

    def flush(self) -> None:
        pass


def _hub_numbers(bars: list[Any]) -> tuple[int, int, int, int] | None:
    """``(bytes_done, bytes_total, files_done, files_total)`` from recorded bars."""
    byte_bars = [b for b in list(bars) if getattr(b, "unit", "") == "B"]
    file_bars = [b for b in list(bars) if getattr(b, "unit", "") != "B"]
    if not byte_bars and not file_bars:
        return None
    done = total = files_done = files_total = 0
    if byte_bars:
        bar = max(byte_bars, key=lambda b: (b.total or 0, b.n or 0))
        done, total = int(bar.n or 0), int(bar.total or 0)
    if file_bars:
        bar = max(file_bars, key=lambda b: b.total or 0)
        files_done, files_total = int(bar.n or 0), int(bar.total or 0)
    return done, total, files_done, files_total


def _tree_numbers(snapshot: Path) -> tuple[int, int]:
    """``(bytes, files)`` of the files in a snapshot directory (symlinks followed)."""
    size = count = 0
    for dirpath, _, filenames in os.walk(snapshot):
        for name in filenames:
            with contextlib.suppress(OSError):
                size += os.stat(os.path.join(dirpath, name)).st_size
                count += 1
    return size, count


async def _fetch_hub(uri: str, *, callback: ProgressCallback, interval: float,
                     stall_timeout_s: float, cache_dir: str | os.PathLike | None,
                     endpoint: str | None, offline: bool | None) -> Path:
    repo_id, revision = parse_hf_uri(uri)
    is_offline = _hub_offline(offline)
    cache = cache_dir or os.environ.get("HF_HUB_CACHE") or None
    endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None
    shown = f"{repo_id}@{revision or 'main'}"
    bars: list[Any] = []
    tracker = _Progress(callback, interval)

    def download() -> str:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                 local_files_only=is_offline, etag_timeout=stall_timeout_s,
                                 endpoint=endpoint,
                                 allow_patterns=list(HUB_ALLOW_PATTERNS),
                                 tqdm_class=_hub_bar_class(bars))

    from huggingface_hub.utils import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                       RepositoryNotFoundError, RevisionNotFoundError)

    task = asyncio.ensure_future(asyncio.to_thread(download))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=interval)
            if done:
                break
            numbers = _hub_numbers(bars)
            if numbers is not None:
                tracker.override = numbers
                tracker.set_wire(numbers[0])
        folder = Path(task.result())
    except GatedRepoError as e:
        raise SourceError("ModelNotFound", f"{repo_id} is a gated repository: set HF_TOKEN to a "
                                           f"token that was granted access ({e})") from e
    except RepositoryNotFoundError as e:
        raise SourceError("ModelNotFound", f"no repository {repo_id} on the Hugging Face Hub "
                                           "(or it is private and HF_TOKEN has no access)") from e
    except RevisionNotFoundError as e:
        raise SourceError("ModelNotFound", f"{repo_id} has no revision {revision!r}") from e
    except LocalEntryNotFoundError as e:
        if is_offline:
            raise SourceError("ModelNotFound",
                              f"{shown} is not (completely) in the local Hugging Face cache "
                              f"{cache or '(default)'}, and offline mode (HF_HUB_OFFLINE) forbids "
                              "downloading it") from e
        raise SourceError("DownloadFailed", f"{shown}: the Hub could not be reached and the "
                                            f"model is not cached: {e}") from e
    except HfHubHTTPError as e:
        raise SourceError("DownloadFailed", f"{shown}: {e}") from e
    except ValueError as e:
        raise SourceError("InvalidSource", f"{uri}: {e}") from e
    except OSError as e:
        raise SourceError("DownloadFailed", f"{shown}: {type(e).__name__}: {e}") from e
    finally:
        if not task.done():
            task.cancel()  # the thread finishes on its own; huggingface_hub locks its blobs
    # snapshots/<commit>/ links into the repository folder's blobs/
    await asyncio.to_thread(check_model_dir, folder, root=folder.parent.parent)
    size, count = await asyncio.to_thread(_tree_numbers, folder)
    tracker.override = (size, size, count, count)
    tracker.maybe_emit(force=True)
    return folder


# ---------------------------------------------------------------------------------------------
# https:// mirrors
# ---------------------------------------------------------------------------------------------


class _Cut(Exception):
    """The connection ended before the file did (retried with a Range request)."""


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


async def _uncancelled(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a thread; if the caller is cancelled, wait for the thread first (so no
    write to a ``.part`` file outlives the lock), then propagate the cancellation."""
    fut = asyncio.ensure_future(asyncio.to_thread(fn))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await fut
        raise


def _fmt_bytes(n: int | None) -> str:
    return "unknown" if n is None else f"{n} bytes"


class _Mirror:
    def __init__(self, uri: str, dest_root: Path, *, callback: ProgressCallback, interval: float,
                 stall_timeout_s: float, max_attempts: int, chunk_bytes: int,
                 ssl_context: ssl.SSLContext | None) -> None:
        self.uri = uri
        self.base = mirror_base_url(uri)
        self.target = mirror_dir(uri, dest_root)
        self.stall = stall_timeout_s
        self.max_attempts = max_attempts
        self.chunk_bytes = chunk_bytes
        self.ssl_context = ssl_context
        self.progress = _Progress(callback, interval)

    # -- top level -----------------------------------------------------------------------------
    async def run(self) -> Path:
        if await asyncio.to_thread(_complete_download, self.target, self.base):
            return await self._adopted()
        await asyncio.to_thread(self.target.parent.mkdir, parents=True, exist_ok=True)
        async with _dir_lock(Path(f"{self.target}.lock")):
            if await asyncio.to_thread(_complete_download, self.target, self.base):
                return await self._adopted()  # another task or process finished it meanwhile
            ctx = self.ssl_context or ssl.create_default_context()
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.stall,
                                            sock_read=self.stall)
            async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False,
                                             headers={"Accept-Encoding": "identity"},
                                             connector=aiohttp.TCPConnector(ssl=ctx)) as session:
                entries = parse_manifest(await self._get_manifest(session),
                                         self.base + MANIFEST_NAME)
                sizes = await asyncio.to_thread(self._prepare, entries)
                self.progress.maybe_emit(force=True)
                for entry in entries:
                    if entry.path in self.progress.done:
                        continue
                    sizes[entry.path] = await self._download(session, entry)
                    if entry.path == "config.json":
                        await asyncio.to_thread(check_config, self.target)
            await asyncio.to_thread(self._finish, entries, sizes)
        await asyncio.to_thread(check_model_dir, self.target)
        self.progress.maybe_emit(force=True)
        return self.target

    async def _adopted(self) -> Path:
        await asyncio.to_thread(check_model_dir, self.target)
        state = _load_state(self.target) or {}
        for item in state.get("files", []):
            self.progress.expected[item["path"]] = item["size"]
            self.progress.local[item["path"]] = item["size"]
            self.progress.done.add(item["path"])
        self.progress.maybe_emit(force=True)
        log.info("model source %s already downloaded in %s", self.base, self.target)
        return self.target

    def _prepare(self, entries: list[ManifestEntry]) -> dict[str, int | None]:
        """Set up the directory and the byte accounting; drop files whose manifest entry
        changed since an earlier, incomplete download."""
        self.target.mkdir(parents=True, exist_ok=True)
        real_target = os.path.realpath(self.target)
        old = {item.get("path"): item for item in (_load_state(self.target) or {}).get("files", [])
               if isinstance(item, dict)}
        _write_json_atomic(self.target / STATE_FILE, {
            "uri": self.base, "complete": False, "files": [e.to_dict() for e in entries]})
        sizes: dict[str, int | None] = {}
        for e in entries:
            final = self.target / e.path
            if not os.path.realpath(final).startswith(real_target + os.sep):
                raise SourceError("InvalidSource",
                                  f"{e.path} would be written outside {self.target}")
            part = final.with_name(final.name + ".part")
            previous = old.get(e.path)
            if previous is not None and (previous.get("sha256"), previous.get("size")) != (
                    e.sha256, e.size):
                for stale in (final, part):
                    with contextlib.suppress(FileNotFoundError):
                        stale.unlink()
            self.progress.expected[e.path] = e.size
            sizes[e.path] = e.size
            if final.is_file() and (e.size is None or final.stat().st_size == e.size):
                # renamed into place only after it was verified
                n = final.stat().st_size
                self.progress.expected[e.path] = sizes[e.path] = n
                self.progress.local[e.path] = n
                self.progress.done.add(e.path)
            elif part.is_file():
                self.progress.local[e.path] = part.stat().st_size
        return sizes

    def _finish(self, entries: list[ManifestEntry], sizes: dict[str, int | None]) -> None:
        _write_json_atomic(self.target / STATE_FILE, {
            "uri": self.base, "complete": True, "completed_unix": time.time(),
            "files": [{"path": e.path, "size": sizes[e.path], "sha256": e.sha256}
                      for e in entries]})

    # -- HTTP ----------------------------------------------------------------------------------
    def _check_final_url(self, resp: aiohttp.ClientResponse, what: str) -> None:
        if resp.url.scheme != "https":
            raise SourceError("DownloadFailed", f"{what} was redirected to {resp.url.scheme}://"
                                                f"{resp.url.host}; only https:// is accepted")

    async def _get_manifest(self, session: aiohttp.ClientSession) -> bytes:
        url = self.base + MANIFEST_NAME
        try:
            async with session.get(url) as resp:
                self._check_final_url(resp, url)
                if resp.status in (404, 410):
                    raise SourceError("ModelNotFound", f"no {MANIFEST_NAME} at {url} (HTTP "
                                                       f"{resp.status}): not a model mirror")
                if resp.status >= 400:
                    raise SourceError("DownloadFailed", f"GET {url}: HTTP {resp.status} "
                                                        f"{resp.reason or ''}".rstrip())
                body = bytearray()
                while chunk := await resp.content.readany():
                    body += chunk
                    if len(body) > _MAX_MANIFEST_BYTES:
                        raise SourceError("InvalidSource", f"{url} is larger than "
                                                           f"{_MAX_MANIFEST_BYTES} bytes")
                return bytes(body)
        except asyncio.TimeoutError as e:
            raise SourceError("DownloadStalled", f"no answer from {url} within "
                                                 f"{self.stall:g}s") from e
        except aiohttp.ClientError as e:
            raise SourceError("DownloadFailed", f"GET {url}: {type(e).__name__}: {e}") from e

    async def _download(self, session: aiohttp.ClientSession, entry: ManifestEntry) -> int:
        """Fetch one file into place (resuming its ``.part``); returns its size."""
        final = self.target / entry.path
        part = final.with_name(final.name + ".part")
        url = self.base + quote(entry.path)
        await asyncio.to_thread(final.parent.mkdir, parents=True, exist_ok=True)
        if await asyncio.to_thread(part.is_file):
            hasher, offset = await asyncio.to_thread(_hash_file, part)
        else:
            hasher, offset = hashlib.sha256(), 0
        expected = entry.size
        self.progress.local[entry.path] = offset
        failures = restarts = 0
        while True:
            if expected is not None and offset > expected:
                await asyncio.to_thread(part.unlink)
                hasher, offset = hashlib.sha256(), 0
                self.progress.local[entry.path] = 0
            if expected is not None and offset == expected:
                break
            start = offset
            try:
                result = await self._get_range(session, url, entry, part, hasher, offset,
                                               expected)
            except _Cut as e:
                offset = e.args[0]
                failures = 0 if offset > start else failures + 1
                if failures >= self.max_attempts:
                    raise SourceError("DownloadFailed",
                                      f"{url}: the connection was lost {failures} times in a row "
                                      f"without progress ({offset} of {_fmt_bytes(expected)} "
                                      "done; the partial file is kept)") from None
                log.warning("download of %s cut at %d bytes; resuming", url, offset)
                if failures:
                    await asyncio.sleep(min(0.25 * 2 ** (failures - 1), 5.0))
                continue
            if result is None:  # the server ignored the Range request or refused it: restart
                hasher, offset = hashlib.sha256(), 0
                self.progress.local[entry.path] = 0
                restarts += 1
                if restarts >= self.max_attempts:
                    raise SourceError("DownloadFailed", f"{url}: the server did not resume the "
                                                        f"download {restarts} times")
                continue
            offset, expected = result
            break
        got = hasher.hexdigest()
        if expected is not None and offset != expected:
            await asyncio.to_thread(part.unlink)
            raise SourceError("DownloadCorrupt", f"{entry.path}: got {offset} bytes, expected "
                                                 f"{expected} ({url}); the file was deleted")
        if entry.sha256 is not None and got != entry.sha256:
            await asyncio.to_thread(part.unlink)
            self.progress.local[entry.path] = 0
            raise SourceError("DownloadCorrupt",
                              f"{entry.path}: sha256 {got} does not match the manifest's "
                              f"{entry.sha256} ({url}); the file was deleted and is fetched again "
                              "on the next attempt")
        await asyncio.to_thread(os.replace, part, final)
        self.progress.expected[entry.path] = offset
        self.progress.done.add(entry.path)
        self.progress.maybe_emit()
        return offset

    async def _get_range(self, session: aiohttp.ClientSession, url: str, entry: ManifestEntry,
                         part: Path, hasher: Any, offset: int,
                         expected: int | None) -> tuple[int, int | None] | None:
        """One GET from ``offset``, appending to ``part`` and ``hasher``. Returns ``(bytes in
        the file, its size)``, or None when the download must restart from 0 (the ``.part`` is
        then truncated). Raises :class:`_Cut` with the bytes on disk after a dropped connection,
        :class:`SourceError` otherwise."""
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        buf = bytearray()
        written = offset

        def flush(sync: bool = False) -> Callable[[], None]:
            data = bytes(buf)
            buf.clear()

            def write() -> None:
                with open(part, "ab") as f:
                    f.write(data)
                    if sync:
                        f.flush()
                        os.fsync(f.fileno())
                hasher.update(data)
            return write

        try:
            async with session.get(url, headers=headers) as resp:
                self._check_final_url(resp, url)
                if resp.status == 416 and offset:
                    await asyncio.to_thread(part.unlink)
                    return None
                if resp.status >= 400:
                    raise SourceError("DownloadFailed", f"GET {url}: HTTP {resp.status} "
                                                        f"{resp.reason or ''}".rstrip())
                total = expected
                announced: int | None = None  # the file's size as the server tells it
                if resp.status == 206:
                    m = re.match(r"bytes (\d+)-(\d+)/(\d+|\*)",
                                 resp.headers.get("Content-Range", ""))
                    if not m or int(m.group(1)) != offset:
                        await asyncio.to_thread(part.unlink)
                        return None
                    if m.group(3) != "*":
                        announced = int(m.group(3))
                elif offset:  # 200: the whole file again
                    await asyncio.to_thread(part.unlink)
                    return None
                else:
                    announced = resp.content_length
                if announced is not None:
                    if total is not None and announced != total:
                        raise SourceError("DownloadCorrupt",
                                          f"{entry.path}: the server has {announced} bytes, the "
                                          f"manifest says {total} ({url})")
                    total = announced
                if total is not None and self.progress.expected.get(entry.path) is None:
                    self.progress.expected[entry.path] = total
                try:
                    while True:
                        data = await resp.content.readany()
                        if not data:
                            break
                        buf += data
                        written += len(data)
                        if total is not None and written > total:
                            buf.clear()
                            with contextlib.suppress(FileNotFoundError):
                                await asyncio.to_thread(part.unlink)
                            raise SourceError("DownloadCorrupt",
                                              f"{entry.path}: the server sent more than the "
                                              f"expected {total} bytes ({url})")
                        self.progress.received(entry.path, len(data))
                        if len(buf) >= self.chunk_bytes:
                            await _uncancelled(flush())
                finally:
                    if buf:
                        await _uncancelled(flush())
                if total is not None and written < total:
                    raise _Cut(written)
                await _uncancelled(flush(sync=True))
                return written, total
        except asyncio.TimeoutError as e:
            raise SourceError("DownloadStalled",
                              f"no data from {url} for {self.stall:g}s while downloading "
                              f"{entry.path} ({written} of {_fmt_bytes(expected)} done; the "
                              "partial file is kept and resumes on the next attempt)") from e
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError,
                aiohttp.ClientOSError) as e:
            if isinstance(e, aiohttp.ClientConnectorError) and written == offset:
                raise SourceError("DownloadFailed", f"GET {url}: {e}") from e
            raise _Cut(written) from e
        except aiohttp.ClientError as e:
            raise SourceError("DownloadFailed", f"GET {url}: {type(e).__name__}: {e}") from e
