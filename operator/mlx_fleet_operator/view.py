"""The operator's in-memory copy of the stored assignments (``assignments/``), and the etcd
revision through which it is known to be complete. Plain data, no I/O.

With 1 000 Macs, listing every assignment from etcd in every reconcile was a large share of the
reconcile's time (each of the ~1 000 reconciles of 500 deployments read them all). Instead the
operator keeps this view current from two sources:

* the assignments follower (:func:`mlx_fleet.views.follow_prefix`): :meth:`reset` with each
  (re-)listing, :meth:`apply` with each watch event;
* its own committed transactions (:meth:`committed`), applied at once, so the next reconcile
  need not wait for the watch to deliver them.

Fencing stays what :func:`.reconcile.read_fleet` documents: the reconcile reads
``placement-epoch`` first and plans from this view only when the view :meth:`covers` the
epoch's ``mod_revision`` E — i.e. every assignment write at a revision ≤ E is reflected. Every
assignment write bumps the epoch (the contract), so any write the view lacks came after E,
moved the epoch, and fails the transaction's compare; the retry re-reads. When the view does
not cover E (a write by another replica or the garbage collector that the watch has not
delivered yet), the reconcile lists ``assignments/`` as before and :meth:`reset` s the view.

Why "complete through" is tracked rather than taken from the last event: a transaction's
events share one revision r and arrive one by one, so after applying an event at r only the
revisions below r are known to be complete; a listing at revision L, or our own transaction
committed at revision T on a view that covered the epoch it compared, are complete through L
or T.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from mlx_fleet.store import KV, Delete, Put, WatchEvent


class AssignmentsView:
    """The assignments by key (``KV`` with its ``mod_revision``), kept as the module docstring
    says. ``complete``: every fenced assignment write at a revision ≤ it is reflected (0: never
    loaded). ``changes``: bumped on every change (a cheap "did anything change" token)."""

    def __init__(self) -> None:
        self._items: dict[str, KV] = {}
        #: key → revision of our own delete that the watch has not delivered yet: an older
        #: PUT of that key arriving late must not bring it back.
        self._deleted: dict[str, int] = {}
        #: Events at or below this revision are already in the last listing.
        self._base = 0
        self.complete = 0
        self.loaded = False
        self.changes = 0
        #: What a reader built from this state, tagged by its owner with ``changes`` at the
        #: time (:func:`.reconcile.read_fleet` keeps its FleetView here); never read here.
        self.derived: tuple | None = None

    def covers(self, epoch_mod_revision: int) -> bool:
        """Whether the view reflects every assignment write up to ``epoch_mod_revision`` (the
        ``placement-epoch`` key's, 0 when it does not exist)."""
        return self.loaded and epoch_mod_revision <= self.complete

    def items(self) -> list[KV]:
        """The assignments, sorted by key (as an etcd listing is)."""
        return [self._items[k] for k in sorted(self._items)]

    def reset(self, items: Sequence[KV], revision: int) -> None:
        """Replace the view with a listing of ``assignments/`` read at ``revision``. A listing
        older than what the view is complete through is ignored (the view is newer)."""
        if self.loaded and revision < self.complete:
            return
        self._items = {kv.key: kv for kv in items}
        self._deleted = {k: r for k, r in self._deleted.items() if r > revision}
        self._base = revision
        self.complete = revision
        self.loaded = True
        self.changes += 1

    def apply(self, ev: WatchEvent) -> None:
        """One watch event of ``assignments/``. Events already reflected (in the last listing,
        or our own writes applied by :meth:`committed`) change nothing."""
        rev = ev.kv.mod_revision
        if rev <= self._base:
            return
        if self._deleted:
            self._deleted = {k: r for k, r in self._deleted.items() if r >= rev}
        have = self._items.get(ev.kv.key)
        if ev.type == "PUT":
            gone = self._deleted.get(ev.kv.key, 0)
            if (have is None or have.mod_revision < rev) and gone < rev:
                self._items[ev.kv.key] = ev.kv
                self._deleted.pop(ev.kv.key, None)
                self.changes += 1
        elif have is not None and have.mod_revision < rev:
            del self._items[ev.kv.key]
            self.changes += 1
        self.complete = max(self.complete, rev - 1)

    def committed(self, ops: Iterable[Put | Delete], revision: int, prefix: str) -> None:
        """Our own transaction committed at ``revision`` with ``ops`` (those under ``prefix``,
        the assignments prefix, are applied). Call it only for a transaction whose compares
        included the epoch the view covered when it was read: then nothing else was written in
        between, and the view is complete through ``revision``."""
        for op in ops:
            if not op.key.startswith(prefix):
                continue
            have = self._items.get(op.key)
            if isinstance(op, Put):
                self._items[op.key] = KV(op.key, op.value, mod_revision=revision,
                                         create_revision=have.create_revision if have else revision,
                                         version=have.version + 1 if have else 1)
                self._deleted.pop(op.key, None)
            else:
                self._items.pop(op.key, None)
                self._deleted[op.key] = revision
        self.complete = max(self.complete, revision)
        self.changes += 1
