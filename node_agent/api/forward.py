"""Relaying a request to the node that serves its revision (a canary candidate elsewhere).

The answer streams back as it comes (:func:`mlx_fleet.routing.proxy.proxy`). The forwarded
request carries the revision pin (:data:`~mlx_fleet.routing.headers.PIN_HEADER`) and the first
fleet-internal forward key as its bearer key, never the client's — and that key only to an
``https://`` or loopback node unless ``insecure_forward`` (``--insecure-forward-http``;
:func:`mlx_fleet.exposure.may_send_key`).
"""

from __future__ import annotations

import logging
import ssl
import time
from typing import Any, Callable

from aiohttp import ClientSession, web

from mlx_fleet.exposure import INSECURE_FORWARD, may_send_key
from mlx_fleet.http_errors import error_response as _error
from mlx_fleet.routing.api_keys import KeyFile
from mlx_fleet.routing.headers import PIN_HEADER
from mlx_fleet.routing.proxy import StreamCut, UpstreamError, client_session, proxy

__all__ = ["Forwarder"]

log = logging.getLogger("node_agent.openai_api")


class Forwarder:
    """Forwards requests to other nodes over one lazily created client session.

    ``router()`` returns the agent's :class:`~node_agent.traffic.TrafficManager` (or None): this
    node records in its statistics only what the serving node cannot see — a node that can't be
    reached or drops the connection (a 503 here or, once the answer's header went out, a cut
    stream), as a candidate failure. ``forward_ssl``: how an ``https://`` node is verified
    (default: the system's trusted CAs). Close with :meth:`close` (the app's cleanup).
    """

    def __init__(self, *, forward_keys: KeyFile | None, forward_ssl: ssl.SSLContext | None,
                 insecure_forward: bool, router: Callable[[], Any]) -> None:
        self._keys = forward_keys
        self._ssl = forward_ssl
        self._insecure = insecure_forward
        self._router = router
        self._session: ClientSession | None = None
        self._refused_by: set[str] = set()  # targets that answered 401 (logged once each)
        self._cleartext_refused: set[str] = set()  # http:// targets not sent the key (once each)
        self._dropped: set[tuple[str, str]] = set()  # (target, revision) answered 404 (once each)

    def _client(self) -> ClientSession:
        if self._session is None:  # created on the running loop, by the first forward
            self._session = client_session(self._ssl)
        return self._session

    async def close(self, _: web.Application | None = None) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    async def __call__(self, request: web.Request, routed: Any, body: bytes
                       ) -> web.StreamResponse | None:
        """Relay ``request`` (its ``body`` already read) to ``routed.route.forward`` pinned to
        ``routed.route.revision``; 503 ``unavailable`` when that node can't be reached. None
        when that node answers 404 (it no longer serves the pinned revision: the canary ended
        and this node has not yet seen its split go); nothing was sent to the client then, and
        the caller serves the request otherwise."""
        t0 = time.perf_counter()
        target = routed.route.forward
        headers = {"Content-Type": "application/json", PIN_HEADER: routed.route.revision}
        keys = self._keys
        if keys is not None and may_send_key(target, insecure=self._insecure):
            keys.current()  # a rotated file is in force for this request already
            headers["Authorization"] = f"Bearer {keys.first}"
        elif keys is not None and target not in self._cleartext_refused:
            self._cleartext_refused.add(target)
            log.warning("not sending the forward key to %s over plain http (give the nodes "
                        "--tls-cert-file, or accept the risk with %s)", target,
                        INSECURE_FORWARD)
        failed = False  # counted here only when the serving node could not be reached
        try:
            resp = await proxy(request, self._client(), target.rstrip("/") + request.path,
                               body=body, headers=headers, retry_statuses=(404,))
        except UpstreamError as e:
            if e.status == 404:
                if (target, routed.route.revision) not in self._dropped:
                    self._dropped.add((target, routed.route.revision))
                    log.warning("%s answered 404 for revision %s (it no longer holds it): "
                                "serving its requests from the stable revision here", target,
                                routed.route.revision)
                return None
            failed = True
            log.warning("forwarding to %s failed: %s", target, e.reason)
            return _error(503, f"the node serving revision {routed.route.revision} is not "
                          f"reachable", type_="server_error", code="unavailable")
        except StreamCut:
            failed = True
            raise
        finally:
            tm = self._router()
            if tm is not None and failed:
                tm.record(routed, latency_s=time.perf_counter() - t0, ttft_s=None,
                          completion_tokens=0, decode_seconds=None, failed=failed)
        if resp.status == 401 and target not in self._refused_by:
            self._refused_by.add(target)
            log.warning("node %s refused a forwarded request (401): check that both nodes "
                        "have the same --forward-key-file", target)
        elif resp.status != 401:
            self._refused_by.discard(target)
        return resp
