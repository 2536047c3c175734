"""The ModelDeployment status writer: statuses computed by the reconciles reach the API server
coalesced, one writer task per deployment.

:func:`queue` puts a status in the deployment's :class:`~.records.StatusQueue` and starts its
writer unless one runs; the writer patches the latest queued status
:data:`STATUS_COALESCE_SECONDS` after it was queued (statuses computed meanwhile replace it), so
the reconcile does not wait for the API server and a burst of changes is one patch. A failed
patch is logged and retried after :data:`STATUS_RETRY_SECONDS` with the latest status by then.
:func:`flush` patches at once (a status that withdraws endpoints: the endpoint grace counts
from its patch). Patches of one deployment never overlap (the queue's lock).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from .records import DeploymentKey, StatusQueue

__all__ = ["STATUS_COALESCE_SECONDS", "STATUS_RETRY_SECONDS", "PatchStatus", "queue", "flush"]

#: Seconds a ModelDeployment's changed status waits before it is patched, so that statuses
#: computed in quick succession (a replica placed, then Ready a moment later; a burst of node
#: changes) reach the API server as one patch of the latest.
#: A status that withdraws endpoints is patched at once: the grace counts from its patch.
STATUS_COALESCE_SECONDS = 0.25
#: Seconds before a failed status patch is tried again (with the latest status by then).
STATUS_RETRY_SECONDS = 2.0

#: Patches ``status`` onto the ModelDeployment ``key`` (raises what the API call raises).
PatchStatus = Callable[[DeploymentKey, dict[str, Any]], Awaitable[None]]

log = logging.getLogger(__name__)


def queue(key: DeploymentKey, q: StatusQueue, status: dict[str, Any], patch: PatchStatus) -> None:
    """Queue ``status`` as ``key``'s latest (``q.last`` and ``q.pending``) and start its writer
    task unless one runs (module docstring)."""
    q.last = q.pending = status
    if q.writer is None or q.writer.done():
        q.writer = asyncio.create_task(_write(key, q, patch), name=f"status {key[0]}/{key[1]}")


async def _write(key: DeploymentKey, q: StatusQueue, patch: PatchStatus) -> None:
    delay = STATUS_COALESCE_SECONDS
    while q.pending is not None:
        await asyncio.sleep(delay)  # the coalescing window (or the retry delay)
        try:
            await flush(key, q, patch)
            delay = STATUS_COALESCE_SECONDS
        except Exception as e:
            log.warning("status of %s/%s not patched (%s: %s); retrying in %.0f s", *key,
                        type(e).__name__, (str(e).splitlines() or [""])[0],
                        STATUS_RETRY_SECONDS)
            delay = STATUS_RETRY_SECONDS


async def flush(key: DeploymentKey, q: StatusQueue, patch: PatchStatus) -> None:
    """Patch ``key``'s queued status now (nothing when none is queued). Raises what the patch
    raised; the status then stays queued (unless a newer one was queued meanwhile)."""
    async with q.lock:
        status, q.pending = q.pending, None
        if status is None:
            return
        try:
            await patch(key, status)
        except BaseException:
            if q.pending is None:
                q.pending = status
            raise
