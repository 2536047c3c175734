"""Whether this operator replica is the active kopf peer: only the active one exports the fleet
metric families (:class:`~.fleet_metrics.FleetCollector`), so two replicas never double them.
Pure: the statuses of the peering objects are passed in.

kopf's peering (``--peering``) keeps one ``ClusterKopfPeering`` (cluster-wide operator) or one
``KopfPeering`` per watched namespace, whose ``status`` maps each replica's identity to
``{"priority", "lastseen", "lifetime"}``. kopf pauses a replica while any *live* other peer
(``lastseen + lifetime`` in the future) has a higher priority, or the same priority (then all of
them pause); see ``process_peering_event`` in kopf/_core/engines/peering.py. :func:`peering_active`
applies the same rule to the same records. A standalone operator is always active.

The operator reads the peering objects every :data:`POLL_SECONDS` (the I/O is in
:mod:`.peering_watch`), so after a takeover the fleet families move from one replica to the other
within that delay (kopf itself hands over only after the old peer's ``lifetime``, 60 s).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["peering_active", "POLL_SECONDS"]

#: Seconds between two reads of the peering objects.
POLL_SECONDS = 5.0


def _deadline(record: Mapping[str, Any]) -> dt.datetime | None:
    try:
        seen = dt.datetime.fromisoformat(str(record["lastseen"]))
        if seen.tzinfo is None:
            seen = seen.replace(tzinfo=dt.timezone.utc)
        return seen + dt.timedelta(seconds=int(record.get("lifetime", 60)))
    except (KeyError, TypeError, ValueError):
        return None  # an unreadable record is not a live peer


def peering_active(statuses: Iterable[Mapping[str, Any] | None], identity: str, priority: int,
                   now: dt.datetime) -> bool:
    """True when no peering object's ``status`` (one per peering object this replica takes part
    in; ``None`` for a missing object or status) holds a live peer other than ``identity`` with
    a priority >= ``priority``. ``now`` must be timezone-aware."""
    for status in statuses:
        for peer, record in (status or {}).items():
            if peer == identity or not isinstance(record, Mapping):
                continue
            deadline = _deadline(record)
            if deadline is None or deadline <= now:
                continue
            try:
                if int(record.get("priority", 0)) >= priority:
                    return False
            except (TypeError, ValueError):
                continue
    return True
