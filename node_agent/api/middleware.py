"""The API's authentication and errors middlewares.

Authentication (:mod:`mlx_fleet.routing.api_keys`): with a key file every request except the
open paths (:data:`~.context.OPEN_PATHS`, and ``/metrics`` unless ``metrics_auth``) needs
``Authorization: Bearer <key>`` with one of its keys or of the fleet-internal ``forward_keys``;
otherwise 401 ``invalid_request_error`` / ``invalid_api_key`` with ``WWW-Authenticate: Bearer``
(the message never repeats what was sent). Without a key file the API is open.

Errors (:func:`mlx_fleet.http_errors.errors_middleware`, shared with the fleet router): every
answer, including a raised :class:`aiohttp.web.HTTPException`, leaves in OpenAI's shape;
anything unexpected is a 500 without the exception's text (logged with its traceback); a client
that hangs up is counted as ``499`` and logged as one INFO line ``client disconnected during
<METHOD> <path>``. Each request is counted
in ``mlxfleet_requests_total`` with its model/revision (:data:`~.context.UNKNOWN_LABEL` unless a
handler set them), its route and status.
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable

from aiohttp import web

from mlx_fleet.http_errors import errors_middleware
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
    """The outermost middleware (:func:`mlx_fleet.http_errors.errors_middleware`, the fleet
    router's too): OpenAI-shaped errors and one count per request in ``requests_total`` (a
    prometheus Counter labelled model, revision, endpoint, code)."""

    def count(request: web.Request, status: int, _seconds: float) -> None:
        route = request.match_info.route
        endpoint = (route.resource.canonical if route is not None
                    and route.resource is not None else "unmatched")
        requests_total.labels(request.get(MODEL, UNKNOWN_LABEL),
                              request.get(REVISION, UNKNOWN_LABEL), endpoint, str(status)).inc()

    return errors_middleware(log=log, count=count, hung_up=lambda r: bool(r.get(HUNG_UP)))
