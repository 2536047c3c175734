"""Download bounds and content digests: pure decisions (no I/O).

* :class:`DownloadLimits` — what the agent allows a download to take: a free-space reserve on
  the cache's filesystem, a cap on the whole model cache, whether ``hf://`` sources may follow
  a branch or tag, and the cache garbage collector's ages (:mod:`.gc`).
* :func:`room_refusal` — before the first byte of a download: does ``need`` more bytes fit
  under the cap and above the reserve? ``None`` or the :class:`SourceError`
  ``InsufficientDisk`` to raise, with the numbers.
* :func:`manifest_digest` / :func:`hub_digest` — the content address of what was fetched,
  reported per replica (:attr:`mlx_fleet.contract.AssignmentReport.digest`).
* :func:`unpinned_refusal` — an ``hf://`` source must pin a 40-hex commit unless
  ``allow_unpinned_hub``.
* :func:`hub_need` — the bytes an ``hf://`` download will fetch, from huggingface_hub's dry
  run; a file it would fetch without a known size refuses the download (fail closed).

Default reserve: 10 % of the filesystem, Kubernetes' kubelet default hard-eviction threshold
``nodefs.available<10%`` (https://kubernetes.io/docs/concepts/scheduling-eviction/
node-pressure-eviction/#hard-eviction-thresholds): a model download never takes the last 10 %
of the disk, as a kubelet evicts pods before a node's disk goes below it.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

from ..model_dir import SourceError

__all__ = ["DownloadLimits", "INSUFFICIENT_DISK", "DEFAULT_RESERVE_FRACTION",
           "DEFAULT_UNUSED_MAX_AGE_S", "DEFAULT_PART_MAX_AGE_S", "room_refusal",
           "manifest_digest", "hub_digest", "is_commit", "unpinned_refusal", "parse_reserve",
           "hub_need"]

#: The failure reason of a download refused for space (the report's ``reason``).
INSUFFICIENT_DISK = "InsufficientDisk"
#: Share of the cache's filesystem kept free (kubelet's ``nodefs.available<10%``).
DEFAULT_RESERVE_FRACTION = 0.10
#: Seconds an unassigned source stays cached (for a quick re-assignment or rollback) before
#: the garbage collector deletes it; sooner when the space is needed.
DEFAULT_UNUSED_MAX_AGE_S = 3600.0
#: Seconds a ``.part`` file of an assigned source may sit without a download writing it.
DEFAULT_PART_MAX_AGE_S = 86400.0
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class DownloadLimits:
    """``reserve_bytes`` / ``reserve_fraction``: the free space kept on the cache's filesystem,
    the larger of the two (bytes; share of the filesystem's size, in [0, 1));
    ``cache_max_bytes``: most bytes the model cache may hold (0 = no cap);
    ``allow_unpinned_hub``: ``hf://`` sources may name a branch or tag (or none: ``main``)
    instead of a commit; ``unused_max_age_s`` / ``part_max_age_s``: the garbage collector's
    ages (:func:`node_agent.fetch.gc.gc_plan`). Raises ``ValueError`` for a negative value or
    a fraction outside [0, 1)."""

    reserve_bytes: int = 0
    reserve_fraction: float = DEFAULT_RESERVE_FRACTION
    cache_max_bytes: int = 0
    allow_unpinned_hub: bool = False
    unused_max_age_s: float = DEFAULT_UNUSED_MAX_AGE_S
    part_max_age_s: float = DEFAULT_PART_MAX_AGE_S

    def __post_init__(self) -> None:
        if self.reserve_bytes < 0 or self.cache_max_bytes < 0:
            raise ValueError("reserve_bytes and cache_max_bytes must be >= 0")
        if not 0 <= self.reserve_fraction < 1:
            raise ValueError(f"reserve_fraction must be in [0, 1), got {self.reserve_fraction}")
        if self.unused_max_age_s < 0 or self.part_max_age_s < 0:
            raise ValueError("the garbage collector's ages must be >= 0")

    def reserve(self, fs_total: int) -> int:
        """Bytes kept free on a filesystem of ``fs_total`` bytes."""
        return max(self.reserve_bytes, math.ceil(self.reserve_fraction * max(fs_total, 0)))


def parse_reserve(text: str, parse_quantity) -> tuple[int, float]:  # noqa: ANN001
    """``--model-cache-reserve``: ``"10%"`` → ``(0, 0.10)``; a Kubernetes quantity
    (``"20Gi"``, via ``parse_quantity``) → ``(bytes, 0.0)``. Raises ``ValueError``."""
    t = text.strip()
    if t.endswith("%"):
        try:
            pct = float(t[:-1])
        except ValueError:
            raise ValueError(f"expected a percentage such as 10% or a quantity such as 20Gi, "
                             f"got {text!r}") from None
        if not 0 <= pct < 100:
            raise ValueError(f"a percentage must be in [0, 100), got {text!r}")
        return 0, pct / 100
    n = parse_quantity(t)
    if n < 0:
        raise ValueError(f"must be at least 0, got {text!r}")
    return n, 0.0


def room_refusal(need: int, *, free: int, fs_total: int, cache_bytes: int,
                 limits: DownloadLimits, what: str) -> SourceError | None:
    """Whether ``need`` more bytes (the manifest's total minus what is already on disk) may be
    downloaded: ``free`` / ``fs_total``: the cache filesystem's free and total bytes
    (``shutil.disk_usage``); ``cache_bytes``: what the model cache holds now. ``what`` names
    the source in the message. Returns None, or the ``InsufficientDisk``
    :class:`SourceError` to raise (with the numbers and the flag to change)."""
    cap = limits.cache_max_bytes
    if cap and cache_bytes + need > cap:
        return SourceError(INSUFFICIENT_DISK,
                           f"{what} needs {need} more bytes; the model cache holds "
                           f"{cache_bytes} of at most {cap} (--model-cache-max-bytes); nothing "
                           "was downloaded")
    reserve = limits.reserve(fs_total)
    if need > free - reserve:
        return SourceError(INSUFFICIENT_DISK,
                           f"{what} needs {need} more bytes; the cache's disk has {free} free "
                           f"and keeps {reserve} in reserve (--model-cache-reserve); nothing was "
                           "downloaded")
    return None


def manifest_digest(files: Iterable[tuple[str, str]]) -> str:
    """The content address of a mirror download: ``"sha256:" +`` sha256 over the lines
    ``"<sha256>  <path>\\n"`` of its files sorted by path (the ``sha256sum`` format), from
    ``(path, sha256 hex)`` pairs. Equal for equal bytes at equal paths, whatever the
    manifest's order or URL."""
    lines = "".join(f"{digest.lower()}  {path}\n" for path, digest in sorted(files))
    return "sha256:" + hashlib.sha256(lines.encode()).hexdigest()


def is_commit(revision: str | None) -> bool:
    """True for a full 40-hex (lower-case) git commit id: an immutable hub revision."""
    return revision is not None and bool(_COMMIT.match(revision))


def hub_digest(commit: str) -> str:
    """The content address of an ``hf://`` download: ``"hf-commit:<40 hex>"``, the commit
    huggingface_hub resolved and downloaded every file at."""
    return f"hf-commit:{commit}"


def unpinned_refusal(uri: str, revision: str | None, *, allow: bool) -> SourceError | None:
    """An ``hf://`` source whose revision is not a 40-hex commit (a branch, a tag, none:
    ``main``) can change under the same URI, so two Macs could hold different weights under
    one ModelDeployment revision: refused (``InvalidSource``) unless ``allow``."""
    if allow or is_commit(revision):
        return None
    shown = revision or "main (no revision)"
    return SourceError("InvalidSource",
                       f"{uri}: hf:// sources must pin a commit (hf://<org>/<repo>@<40-hex "
                       f"commit>); {shown!s} is a branch or tag that can move. Pin the commit, "
                       "or start the agent with --allow-unpinned-hub-revisions (the commit it "
                       "resolves to is reported per replica)")


def hub_need(files: Iterable[tuple[str, int | None, bool]], *, what: str) -> int:
    """The bytes an ``hf://`` download will fetch, from huggingface_hub's dry run:
    ``(filename, file_size or None, will_download)`` per file. A file to fetch whose size the
    hub did not give can't be checked against the disk or the cap, so the download is
    refused: raises the ``InvalidSource`` :class:`SourceError` naming it (``what`` names the
    source). Files already cached count 0."""
    need = 0
    for name, size, will_download in files:
        if not will_download:
            continue
        if size is None or size < 0:
            raise SourceError("InvalidSource",
                              f"{what}: the hub did not say the size of {name}, so the download "
                              "can't be checked against the disk's reserve and the cache's cap; "
                              "nothing was downloaded")
        need += size
    return need
