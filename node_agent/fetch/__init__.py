"""Download a remote model source into a local model directory, with progress.

:func:`fetch` resolves ``hf://`` and ``https://`` sources (local ones are
:func:`node_agent.sources.resolve_source`'s) and returns the local directory, checked by
:func:`node_agent.model_dir.check_model_dir` (no symlink out of the model, a ``config.json``
object, no custom code). One module per job:

* :mod:`.manifest` — the source URIs and the mirror manifest, parsed and checked (pure);
* :mod:`.hub` — ``hf://<org>/<repo>[@<revision>]``: a Hugging Face Hub repository through
  huggingface_hub and its cache;
* :mod:`.mirror` — ``https://host/path/``: a mirror directory holding ``manifest.json``,
  downloaded with ranged resume, size and sha256 checks;
* :mod:`.cache` — the download cache on disk: default directory, state file, lock, its
  garbage collection (:func:`collect_garbage`) and what a download is (:func:`digest_of`);
* :mod:`.bounds` — the limits a download must fit (:class:`DownloadLimits`: disk reserve,
  cache cap, pinned ``hf://`` commits) and the content digests (pure);
* :mod:`.gc` — which cached sources and ``.part`` files to delete (pure);
* :mod:`.hops` — ``https://`` requests under the source policy: every resolved address
  checked, redirects followed by hand with each hop checked;
* :mod:`.progress` — the :class:`~mlx_fleet.contract.DownloadProgress` reports.

Every source is first checked against the fleet's source policy (``policy``,
:mod:`mlx_fleet.source_policy`), before any connection or cache look-up; ``https://`` requests
check every resolved address and every redirect hop (:mod:`.hops`); ``hf://`` sends the Mac's
``HF_TOKEN`` only for the policy's ``hfTokenOrganizations``.

Content addressing: a mirror's every file has a size and a sha256 (else ``InvalidSource``
before any byte), and the download's digest is ``sha256:`` over its sorted ``(path,
sha256)`` list; an ``hf://`` source must pin a 40-hex commit (else ``InvalidSource``, unless
``DownloadLimits.allow_unpinned_hub``: huggingface_hub then resolves the branch or tag to a
commit once and downloads every file at that commit), its digest is ``hf-commit:<commit>``.
:func:`digest_of` reads either from the directory :func:`fetch` returns.

Failures raise :class:`~node_agent.model_dir.SourceError`: ``SourceRefused`` (the source
policy refuses the source, an address it resolves to, or a redirect), ``ModelNotFound`` (no such repository
or revision, not cached while offline, no manifest at the mirror), ``InvalidSource`` (malformed
URI or manifest, an unpinned ``hf://`` revision, unsafe path, bad model directory),
``InsufficientDisk`` (over the cache's cap or the disk's reserve; nothing was downloaded;
``hf://``: a file the hub gives no size for is ``InvalidSource`` and a dry run that fails is
``DownloadFailed``, unless the revision is cached),
``DownloadFailed`` (an HTTP error status,
the connection lost too often, TLS failure, hub unreachable), ``DownloadStalled`` (no byte for
``stall_timeout_s``; names the file and the bytes done), ``DownloadCorrupt`` (size or sha256
mismatch; the bad file is deleted). Partial files are kept, so calling again resumes.
Cancelling the awaiting task stops an ``https://`` download at once (between chunks); an
``hf://`` download runs on in its thread until huggingface_hub finishes it.
"""

from __future__ import annotations

import os
import shutil
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from mlx_fleet.source_policy import DEFAULT_POLICY, SourcePolicy, hf_token_allowed

from ..model_dir import SourceError
from .bounds import INSUFFICIENT_DISK, DownloadLimits, unpinned_refusal
from .cache import (_CHUNK_BYTES, MakeRoom, cache_bytes, cache_entry_name, collect_garbage,
                    default_model_cache, digest_of, hub_cache_dir, owns_hub_cache, touch_entry)
from .hops import refuse_source
from .hub import HUB_ALLOW_PATTERNS, _fetch_hub
from .manifest import (MANIFEST_NAME, STATE_FILE, ManifestEntry, mirror_base_url, mirror_dir,
                       parse_hf_uri, parse_manifest)
from .mirror import _Mirror
from .progress import PROGRESS_INTERVAL_S, RATE_WINDOW_S, ProgressCallback, _ignore

__all__ = ["fetch", "default_model_cache", "parse_hf_uri", "mirror_base_url", "mirror_dir",
           "parse_manifest", "ManifestEntry", "ProgressCallback", "MANIFEST_NAME", "STATE_FILE",
           "HUB_ALLOW_PATTERNS", "DEFAULT_STALL_TIMEOUT_S", "PROGRESS_INTERVAL_S",
           "RATE_WINDOW_S", "DownloadLimits", "INSUFFICIENT_DISK", "MakeRoom", "digest_of",
           "collect_garbage", "cache_bytes", "cache_entry_name", "hub_cache_dir",
           "touch_entry"]

#: Seconds without a byte before a download fails with ``DownloadStalled``.
DEFAULT_STALL_TIMEOUT_S = 60.0


async def fetch(uri: str, dest_root: str | os.PathLike, *,
                progress: ProgressCallback | None = None,
                stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
                progress_interval_s: float = PROGRESS_INTERVAL_S,
                max_attempts: int = 5,
                chunk_bytes: int = _CHUNK_BYTES,
                ssl_context: ssl.SSLContext | None = None,
                hf_cache_dir: str | os.PathLike | None = None,
                hf_endpoint: str | None = None,
                offline: bool | None = None,
                limits: DownloadLimits | None = None,
                disk_usage: Callable[[str], Any] = shutil.disk_usage,
                make_room: MakeRoom | None = None,
                policy: SourcePolicy = DEFAULT_POLICY) -> Path:
    """Download ``uri`` (``hf://`` or ``https://``) unless it is already complete on disk, and
    return the checked local model directory.

    ``dest_root``: where ``https://`` mirrors are stored (``dest_root/https/<name>/``); when
    ``hf_cache_dir`` is ``dest_root/hf`` (the agent's own, :func:`hub_cache_dir`), ``hf://``
    downloads count under ``limits``' cap too;
    ``progress``: receives :class:`DownloadProgress` at most every ``progress_interval_s``
    seconds and once at the end (see the module docstring); ``stall_timeout_s``: seconds
    without a byte (or without an answer) before ``DownloadStalled``; ``max_attempts``:
    connection losses per file, in a row without progress, before ``DownloadFailed``;
    ``chunk_bytes``: bytes hashed and written per disk write; ``ssl_context``: certificate
    checks (default: the system trust store, honouring ``SSL_CERT_FILE``/``SSL_CERT_DIR``).
    ``hf_cache_dir``/``hf_endpoint``/``offline``: the Hugging Face cache, Hub URL (a Hub
    mirror) and offline mode (defaults: ``$HF_HUB_CACHE``, ``$HF_ENDPOINT``, ``$HF_HUB_OFFLINE``
    read at call time, else huggingface_hub's own). ``limits``: the disk reserve, cache cap
    and whether ``hf://`` may follow a branch (default :class:`DownloadLimits`: 10 % reserve,
    no cap, commits only); ``disk_usage``: ``shutil.disk_usage`` (injectable: a full disk
    can't be made in a test); ``make_room(need, shortfall)``: awaited once when a download
    does not fit, before it is refused (the agent's garbage collector). ``policy``: the
    fleet's source policy (default the secure :data:`~mlx_fleet.source_policy.DEFAULT_POLICY`:
    public addresses only, no token).

    Raises :class:`~node_agent.model_dir.SourceError` (reasons in the module docstring);
    ``UnsupportedSource`` for another scheme."""
    callback = progress or _ignore
    limits = limits or DownloadLimits()
    scheme = urlsplit(uri.strip()).scheme.lower()
    if scheme in ("hf", "https"):
        parse_hf_uri(uri) if scheme == "hf" else mirror_base_url(uri)  # InvalidSource first
        refuse_source(policy, uri)
    if scheme == "hf":
        refusal = unpinned_refusal(uri, parse_hf_uri(uri)[1], allow=limits.allow_unpinned_hub)
        if refusal is not None:
            raise refusal
        hub_cache = hf_cache_dir or os.environ.get("HF_HUB_CACHE") or None
        owned = owns_hub_cache(Path(dest_root), hub_cache)
        return await _fetch_hub(uri, callback=callback, interval=progress_interval_s,
                                stall_timeout_s=stall_timeout_s, cache_dir=hub_cache,
                                endpoint=hf_endpoint, offline=offline, limits=limits,
                                disk_usage=disk_usage, make_room=make_room,
                                use_token=hf_token_allowed(policy, uri),
                                model_cache=Path(dest_root) if owned else None)
    if scheme == "https":
        return await _Mirror(uri, Path(dest_root), callback=callback,
                             interval=progress_interval_s, stall_timeout_s=stall_timeout_s,
                             max_attempts=max(1, max_attempts), chunk_bytes=max(1, chunk_bytes),
                             ssl_context=ssl_context, limits=limits, disk_usage=disk_usage,
                             make_room=make_room, policy=policy).run()
    raise SourceError("UnsupportedSource", f"cannot fetch {scheme or 'a local'}:// source {uri!r}")
