"""The ``https://`` source: a mirror directory downloaded file by file with ranged resume.

A directory served over HTTPS holding ``manifest.json`` (format in
:mod:`node_agent.fetch.manifest`; the URI may also name the manifest itself:
``https://host/path/manifest.json``). Every entry's size and sha256 are required
(:func:`~node_agent.fetch.manifest.parse_manifest`): before the first byte, the bytes still to
fetch are checked against the cache's cap and the disk's free space minus its reserve
(:func:`~node_agent.fetch.bounds.room_refusal`; ``make_room`` may free space first — the
agent's garbage collector — then ``InsufficientDisk``); a server announcing another size, or
sending one byte more than declared (any transfer encoding), fails the file; its sha256 is
checked before it is moved into place. Each file is fetched from
``<base>/<path>`` (percent-encoded) into ``dest_root/https/<name>/``
(:func:`~node_agent.fetch.manifest.mirror_dir`). A file is written to ``<path>.part``,
resumed with ``Range: bytes=<done>-`` after a dropped connection (up to ``max_attempts``
tries without progress) and on the next call after a failure, checked, then renamed into
place. ``config.json`` comes first and is checked before any weights are fetched. The
manifest is kept as the state file; once every file is verified it is marked complete, and
later calls (an agent restart) adopt the directory without contacting the server (files are
checked by size; :mod:`node_agent.fetch.cache`). A mirror path should therefore be immutable
(one path per model version); if the manifest changes while a download is incomplete, files
whose entry changed are fetched again. Certificates are checked against the system trust
store (``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` at call time name a private CA) or
``ssl_context``. Every request goes through :mod:`node_agent.fetch.hops` under the fleet's
source policy: each resolved address checked before it is connected, redirects followed by
hand with each hop checked (``https://`` only, allowed hosts, at most ``maxRedirects``). A
file lock (``<dir>.lock``) serializes fetches of one URI across tasks and processes.

``_Mirror(...).run()`` returns the checked directory. It raises
:class:`~node_agent.model_dir.SourceError`: ``ModelNotFound`` (no manifest at the mirror),
``InvalidSource`` (a malformed manifest — an entry without a size or sha256 —, an unsafe path,
a bad model directory), ``InsufficientDisk`` (the download would exceed the cache's cap or eat
into the disk's reserve; nothing was downloaded), ``SourceRefused`` (the source policy refuses
an address or a redirect),
``DownloadFailed`` (an HTTP error status, the connection lost too often, TLS failure),
``DownloadStalled`` (no byte for ``stall_timeout_s``; names the file and the bytes done),
``DownloadCorrupt`` (size or sha256 mismatch; the bad file is deleted). Partial files are
kept, so calling again resumes. Cancelling the awaiting task stops the download at once
(between chunks; a disk write in progress finishes first).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import shutil
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp

from mlx_fleet.mirror_manifest import hash_file
from mlx_fleet.source_policy import DEFAULT_POLICY, SourcePolicy

from ..model_dir import SourceError, check_config, check_model_dir
from .bounds import DownloadLimits, manifest_digest
from .cache import (MakeRoom, _complete_download, _dir_lock, _load_state,
                    _write_json_atomic, ensure_room, touch_state)
from .manifest import (MANIFEST_NAME, STATE_FILE, ManifestEntry, mirror_base_url, mirror_dir,
                       parse_manifest)
from .hops import get, policy_session
from .progress import ProgressCallback, _Progress

log = logging.getLogger("node_agent.fetch")  # the name its log lines always had

_MAX_MANIFEST_BYTES = 4 * 2**20


class _Cut(Exception):
    """The connection ended before the file did (retried with a Range request)."""


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
                 ssl_context: ssl.SSLContext | None, limits: DownloadLimits | None = None,
                 disk_usage: Callable[[str], Any] = shutil.disk_usage,
                 make_room: MakeRoom | None = None,
                 policy: SourcePolicy = DEFAULT_POLICY) -> None:
        self.uri = uri
        self.policy = policy
        self.base = mirror_base_url(uri)
        self.dest_root = dest_root
        self.target = mirror_dir(uri, dest_root)
        self.limits = limits or DownloadLimits()
        self.disk_usage = disk_usage
        self.make_room = make_room
        self.stall = stall_timeout_s
        self.max_attempts = max_attempts
        self.chunk_bytes = chunk_bytes
        self.ssl_context = ssl_context
        self.progress = _Progress(callback, interval)

    # -- top level -----------------------------------------------------------------------------
    async def run(self) -> Path:
        await asyncio.to_thread(self.target.parent.mkdir, parents=True, exist_ok=True)
        # adopted under the lock too: the cache's garbage collector deletes under it
        async with _dir_lock(Path(f"{self.target}.lock")):
            if await asyncio.to_thread(_complete_download, self.target, self.base):
                return await self._adopted()  # complete already (another task, a restart)
            ctx = self.ssl_context or ssl.create_default_context()
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.stall,
                                            sock_read=self.stall)
            async with policy_session(self.policy, ssl_context=ctx, timeout=timeout,
                                      headers={"Accept-Encoding": "identity"}) as session:
                entries = parse_manifest(await self._get_manifest(session),
                                         self.base + MANIFEST_NAME)
                sizes = await asyncio.to_thread(self._prepare, entries)
                await self._check_room(entries)
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

    async def _check_room(self, entries: list[ManifestEntry]) -> None:
        """Before the first byte: the bytes still to fetch against the cache's cap and the
        disk's free space minus its reserve; ``make_room`` is asked once to free what is
        missing. Raises ``InsufficientDisk``."""
        need = sum(max(e.size - self.progress.local.get(e.path, 0), 0) for e in entries
                   if e.path not in self.progress.done)
        await ensure_room(need, where=self.target, limits=self.limits,
                          disk_usage=self.disk_usage, make_room=self.make_room, what=self.base,
                          model_cache=self.dest_root)

    async def _adopted(self) -> Path:
        await asyncio.to_thread(check_model_dir, self.target)
        await asyncio.to_thread(touch_state, self.target)
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
            "digest": manifest_digest((e.path, e.sha256) for e in entries),
            "files": [{"path": e.path, "size": sizes[e.path], "sha256": e.sha256}
                      for e in entries]})

    # -- HTTP ----------------------------------------------------------------------------------
    async def _get_manifest(self, session: aiohttp.ClientSession) -> bytes:
        url = self.base + MANIFEST_NAME
        try:
            async with get(session, self.policy, url) as resp:
                if resp.status in (404, 410):
                    raise SourceError("ModelNotFound", f"no {MANIFEST_NAME} at {url} (HTTP "
                                                       f"{resp.status}): not a model mirror",
                                      http_status=resp.status)
                if resp.status >= 400:
                    raise SourceError("DownloadFailed", f"GET {url}: HTTP {resp.status} "
                                                        f"{resp.reason or ''}".rstrip(),
                                      http_status=resp.status)
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
            hasher, offset = await asyncio.to_thread(hash_file, part)
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
            async with get(session, self.policy, url, headers=headers) as resp:
                if resp.status == 416 and offset:
                    await asyncio.to_thread(part.unlink)
                    return None
                if resp.status >= 400:
                    raise SourceError("DownloadFailed", f"GET {url}: HTTP {resp.status} "
                                                        f"{resp.reason or ''}".rstrip(),
                                      http_status=resp.status)
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
