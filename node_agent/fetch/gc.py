"""The model cache's garbage collection: which cached sources and ``.part`` files to delete —
a pure decision (no I/O); :func:`node_agent.fetch.cache.collect_garbage` gathers the entries
and applies the plan.

An *entry* is one ``https://`` mirror download (``<cache>/https/<name>/``,
:func:`~node_agent.fetch.manifest.mirror_dir`) or one revision of a repository in the agent's
own Hugging Face cache (``<cache>/hf/models--<org>--<repo>/snapshots/<commit>``, named
``hf@models--<org>--<repo>@<commit>``, in the *group* ``hf@models--<org>--<repo>``:
:func:`~node_agent.fetch.cache.cache_entry_name`). :func:`gc_plan` never deletes an entry
that is *protected* — assigned to this node (any state, standby included), loaded or being
loaded, by its name or its group (an ``hf://`` source that follows a branch protects every
revision of its repository), or *active* (a download holds its lock) — and deletes, in this
order:

1. stale ``.part`` files of protected, inactive entries: not written for ``part_max_age_s``
   (a download that will not resume them soon; the next attempt starts that file again);
2. unprotected entries unused for ``unused_max_age_s`` (reason ``Unassigned``), least
   recently used first;
3. more unprotected entries, least recently used first, while the cache would exceed its cap
   after ``need`` more bytes, or while ``shortfall`` bytes are still to be freed on the disk
   (reason ``SpaceNeeded``).

Like the kubelet's image garbage collection (unused images, least recently used first, when
the disk is short; unused ones older than ``imageMaximumGCAge``), with "unused" meaning "not
assigned here".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["PartFile", "CacheEntry", "Deletion", "gc_plan", "STALE_PART", "UNASSIGNED",
           "SPACE_NEEDED"]

STALE_PART = "StalePart"
UNASSIGNED = "Unassigned"
SPACE_NEEDED = "SpaceNeeded"


@dataclass(frozen=True)
class PartFile:
    """A ``.part`` file: ``path`` relative to its entry, ``bytes``, ``mtime`` (unix seconds)."""

    path: str
    bytes: int
    mtime: float


@dataclass(frozen=True)
class CacheEntry:
    """One cached source: ``name`` (its directory's name, or ``hf@<repo folder>@<commit>``),
    ``bytes`` on disk (``.part`` files included; for a hub revision, its blobs no other
    revision shares), ``last_used`` (unix seconds: its last download or adoption), ``active``
    (a download holds it now), its ``parts``, ``group`` (``hf@<repo folder>`` for a hub
    revision: protected too when the group is assigned or loaded; ``""`` for none)."""

    name: str
    bytes: int
    last_used: float
    active: bool = False
    parts: tuple[PartFile, ...] = field(default_factory=tuple)
    group: str = ""


@dataclass(frozen=True)
class Deletion:
    """Delete ``name``'s ``.part`` file ``part`` — or, when ``part`` is None, the whole entry —
    freeing ``bytes``, for ``reason`` (:data:`STALE_PART`, :data:`UNASSIGNED`,
    :data:`SPACE_NEEDED`)."""

    name: str
    bytes: int
    reason: str
    part: str | None = None


def gc_plan(entries: Iterable[CacheEntry], assigned: Iterable[str], loaded: Iterable[str],
            now: float, cap: int, *, need: int = 0, shortfall: int = 0,
            unused_max_age_s: float, part_max_age_s: float) -> list[Deletion]:
    """The deletions, in the order to apply them (rules in the module docstring).

    ``assigned`` / ``loaded``: entry names (or groups) assigned to this node / loaded or being
    loaded;
    ``now``: unix seconds; ``cap``: the cache's most bytes (0 = no cap); ``need``: bytes a
    download is about to add; ``shortfall``: bytes the disk lacks for it (beyond its reserve);
    ages in seconds."""
    entries = sorted(entries, key=lambda e: (e.last_used, e.name))
    keep = set(assigned) | set(loaded)

    def kept(e: CacheEntry) -> bool:
        return e.name in keep or bool(e.group) and e.group in keep

    plan: list[Deletion] = []
    total = sum(e.bytes for e in entries)
    freed = 0
    for e in entries:
        if kept(e) and not e.active:
            for p in sorted(e.parts, key=lambda p: p.path):
                if now - p.mtime >= part_max_age_s:
                    plan.append(Deletion(e.name, p.bytes, STALE_PART, p.path))
                    freed += p.bytes
    candidates = [e for e in entries if not kept(e) and not e.active]
    rest = []
    for e in candidates:
        if now - e.last_used >= unused_max_age_s:
            plan.append(Deletion(e.name, e.bytes, UNASSIGNED))
            freed += e.bytes
        else:
            rest.append(e)
    for e in rest:
        over_cap = bool(cap) and total - freed + need > cap
        if not over_cap and freed >= shortfall:
            break
        plan.append(Deletion(e.name, e.bytes, SPACE_NEEDED))
        freed += e.bytes
    return plan
