"""The API's authentication and errors middlewares.

Authentication (:mod:`mlx_fleet.routing.api_keys`): with a key file every request except the
open paths (:data:`~.context.OPEN_PATHS`, and ``/metrics`` unless ``metrics_auth``) needs
``Authorization: Bearer <key>`` with one of its keys or of the fleet-internal ``forward_keys``;
otherwise 401 ``invalid_request_error`` / ``invalid_api_key`` with ``WWW-Authenticate: Bearer``
(the message never repeats what was sent). Without a key file the API is open.

Errors: every answer, including a raised :class:`aiohttp.web.HTTPException`, leaves in OpenAI's
shape (:func:`mlx_fleet.http_errors.error_response`); anything unexpected is a 500 without the
exception's text (logged with its traceback); a client that hangs up is counted as ``499`` and
logged as one INFO line ``client disconnected during <METHOD> <path>``. Each request is counted
in ``mlxfleet_requests_total`` with its model/revision (:data:`~.context.UNKNOWN_LABEL` unless a
handler set them), its route and status.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from aiohttp import web

from mlx_fleet.http_errors import error_response as _error
from mlx_fleet.http_errors import unauthorized as _unauthorized
from mlx_fleet.routing.api_keys import KeyFile, bearer_token, matches

from .context import FLEET_INTERNAL, HUNG_UP, MODEL, REVISION, UNKNOWN_LABEL

__all__ = ["authentication", "keyed", "request_errors"]

log = logging.getLogger("node_agent.openai_api")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def keyed(request: web.Request, api_keys: KeyFile | None, forward_keys: KeyFile | None) -> bool:
    """The request presents one of the client or fleet-internal keys (both sets compared)."""
    presented = bearer_token(request.headers.get("Authorization"))
    client = api_keys is not None and matches(presented, api_keys.current())
    internal = forward_keys is not None and matches(presented, forward_keys.current())
    return client or internal


def authentication(api_keys: KeyFile | None, forward_keys: KeyFile | None,
                   open_paths: frozenset[str]) -> Any:
    """The authentication middleware; it sets :data:`~.context.FLEET_INTERNAL` on the request
    (True with no keys at all: then nothing tells a fleet-internal request apart)."""

    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        if api_keys is None:
            request[FLEET_INTERNAL] = True
            return await handler(request)
        if request.path in open_paths:
            return await handler(request)
        presented = bearer_token(request.headers.get("Authorization"))
        # both sets are always compared (no early exit: the time does not say which matched)
        client = matches(presented, api_keys.current())
        internal = forward_keys is not None and matches(presented, forward_keys.current())
        if not (client or internal):
            return _unauthorized(presented)
        request[FLEET_INTERNAL] = internal
        return await handler(request)

    return authenticate


def request_errors(requests_total: Any) -> Any:
    """The outermost middleware: OpenAI-shaped errors and one count per request in
    ``requests_total`` (a prometheus Counter labelled model, revision, endpoint, code)."""

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            if request.get(HUNG_UP):
                # a stream the client left mid-way: its 200 header is already out, but the
                # request did not complete
                status = 499
                log.info("client disconnected during %s %s", request.method, request.path)
            return resp
        except web.HTTPException as e:
            status = e.status
            if e.status < 400:
                raise
            headers = {k: v for k, v in e.headers.items() if k.lower() in {"allow"}}
            type_ = "invalid_request_error" if e.status < 500 else "server_error"
            code = {404: "not_found", 405: "method_not_allowed",
                    413: "request_too_large"}.get(e.status)
            return _error(e.status, e.reason or "error", type_=type_, code=code,
                          headers=headers)
        except ConnectionResetError:
            # the client hung up before the response: not a server error, so no traceback
            status = 499
            log.info("client disconnected during %s %s", request.method, request.path)
            return web.Response(status=499)  # aiohttp drops it: the transport is closing
        except asyncio.CancelledError:
            # handler_cancellation: aiohttp cancels the handler when the client disconnects
            status = 499
            log.info("client disconnected during %s %s", request.method, request.path)
            raise
        except Exception:  # noqa: BLE001 - never let a request take the server down
            log.exception("unexpected error serving %s %s", request.method, request.path)
            return _error(500, "internal server error", type_="server_error",
                          code="internal_error")
        finally:
            route = request.match_info.route
            endpoint = (route.resource.canonical if route is not None
                        and route.resource is not None else "unmatched")
            requests_total.labels(request.get(MODEL, UNKNOWN_LABEL),
                                  request.get(REVISION, UNKNOWN_LABEL),
                                  endpoint, str(status)).inc()

    return errors
