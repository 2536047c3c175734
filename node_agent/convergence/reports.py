"""Writing the per-assignment reports (:class:`~mlx_fleet.contract.AssignmentReport` at
``keys.report(node, ns, name, revision)``) through
:class:`~node_agent.registration.Registration`, bound to the node's lease: the one place their
wording lives (Ready, standby, Prefetching, Failed, deleted)."""

from __future__ import annotations

import asyncio

from mlx_fleet.capabilities import ModelCapabilities
from mlx_fleet.contract import (AWAITING_REQUEST, Assignment, AssignmentReport, AssignmentState,
                                DownloadProgress)

from ..registration import Registration
from .runtime import Runtime
from .state import Loaded, Spec

__all__ = ["Reports"]


class Reports:
    """Writes ``rt``'s reports with ``registration``; ``advertise_url``: the ``endpoint`` of
    Ready and standby reports. Every write is shielded: a key's task cancelled meanwhile never
    cuts a report's write short."""

    def __init__(self, rt: Runtime, registration: Registration, advertise_url: str) -> None:
        self._rt = rt
        self._reg = registration
        self.advertise_url = advertise_url

    async def put(self, key: str, state: AssignmentState, *, namespace: str, name: str,
                  generation: int, revision: str = "", reason: str = "", message: str = "",
                  endpoint: str = "", resident_bytes: int = 0, freed_bytes: int = 0,
                  estimated_bytes: int = 0, progress: DownloadProgress | None = None,
                  digest: str = "",
                  capabilities: ModelCapabilities | None = None) -> None:
        """Write ``key``'s report (kept as its record's ``report`` too)."""
        report = AssignmentReport(
            node=self._rt.node_name, namespace=namespace, name=name, generation=generation,
            revision=revision, state=state, reason=reason, message=message, endpoint=endpoint,
            resident_bytes=resident_bytes, freed_bytes=freed_bytes,
            estimated_bytes=estimated_bytes, progress=progress, capabilities=capabilities,
            digest=digest)
        self._rt.record(key).report = report
        await asyncio.shield(self._reg.put_report(self._rt.report_key(key), report))

    async def delete(self, key: str) -> None:
        """Delete ``key``'s report."""
        self._rt.record(key).report = None
        await self._reg.delete_report(self._rt.report_key(key))

    async def ready(self, key: str, a: Assignment, loaded: Loaded) -> None:
        await self.put(key, AssignmentState.READY, namespace=a.namespace, name=a.name,
                       generation=a.generation, revision=loaded.spec.revision,
                       reason="ModelLoaded", endpoint=self.advertise_url,
                       message=f"serving {loaded.spec.model_id} from {loaded.spec.uri}",
                       resident_bytes=loaded.resident_bytes,
                       estimated_bytes=loaded.estimated_bytes,
                       capabilities=loaded.capabilities, digest=loaded.digest)

    async def standby(self, key: str, a: Assignment, loaded: Loaded) -> None:
        """Report a standby revision: ``Unloaded`` with reason ``IdleUnloaded``, ``Evicted`` or
        ``AwaitingRequest`` (:func:`~mlx_fleet.contract.is_standby`), still at its endpoint (a
        request loads it), nothing resident, the bytes its unload freed, and the capabilities
        of its last load here (None when it was never loaded here)."""
        unload = loaded.unload
        reason = loaded.reason
        if unload is not None:
            message = unload.message()
        elif reason == AWAITING_REQUEST:
            message = (f"lifecycle.prefetch is OnDemand: {loaded.spec.model_id} is fetched and "
                       f"loaded from {loaded.spec.uri} at the first request")
        else:
            message = "unloaded while idle; the next request reloads it"
        await self.put(key, AssignmentState.UNLOADED, namespace=a.namespace, name=a.name,
                       generation=a.generation, revision=loaded.spec.revision, reason=reason,
                       endpoint=self.advertise_url, message=message, resident_bytes=0,
                       freed_bytes=unload.freed_bytes if unload is not None else 0,
                       estimated_bytes=loaded.estimated_bytes,
                       capabilities=loaded.capabilities, digest=loaded.digest)

    async def prefetching(self, key: str, spec: Spec, progress: DownloadProgress,
                          common: dict, estimated_bytes: int) -> None:
        await self.put(key, AssignmentState.PREFETCHING, reason="FetchingModel",
                       message=f"downloading {spec.model_id} from {spec.uri}",
                       progress=progress, estimated_bytes=estimated_bytes, **common)
